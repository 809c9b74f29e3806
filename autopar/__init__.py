"""autopar: compiler-style auto-parallelization for PyTorch training."""

from __future__ import annotations

from autopar.errors import AutoparError

__version__ = "0.1.0"

__all__ = ["AutoparError", "__version__", "compile", "init_mesh"]


def compile(*args, **kwargs):  # noqa: A001 - mirrors torch.compile's name on purpose
    """Capture, plan and shard ``model`` over ``mesh``; see :func:`autopar.api.compile`."""
    from autopar.api import compile as _compile

    return _compile(*args, **kwargs)


def init_mesh(*args, **axes):
    """A DeviceMesh with named axes, checked against the world size; see :func:`autopar.api.init_mesh`."""
    from autopar.api import init_mesh as _init_mesh

    return _init_mesh(*args, **axes)
