"""autopar: compiler-style auto-parallelization for PyTorch training.

mesh = autopar.init_mesh(dp=2, tp=2)
model = autopar.compile(model, mesh, kwargs=batch, config=autopar.TrainConfig(zero=2))
autopar.checkpoint.save("ckpt", model, opt)

The names below are imported when first used (PEP 562), so ``import autopar`` and commands that need
none of them (``autopar plan --list-models``) do not import torch and the whole stack.
"""

from __future__ import annotations

import importlib
from typing import Any

from autopar import _moved
from autopar.errors import AutoparError

_moved.install()  # the module paths of autopar 0.1 keep importing, deprecated

__version__ = "0.1.0"

# public name -> (module, attribute; None: the module itself)
_LAZY: dict[str, tuple[str, str | None]] = {
    "ClusterSpec": ("autopar.solver.cluster.spec", "ClusterSpec"),
    "MixedPrecisionPolicy": ("autopar.runtime.build.precision", "MixedPrecisionPolicy"),
    "Plan": ("autopar.plan", "Plan"),
    "TrainConfig": ("autopar.config", "TrainConfig"),
    "checkpoint": ("autopar.checkpoint", None),
    "compile": ("autopar.api", "compile"),
    "data": ("autopar.data", None),
    "init_mesh": ("autopar.api", "init_mesh"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    module, attr = _LAZY[name]
    value = importlib.import_module(module)
    if attr is not None:
        value = getattr(value, attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "AutoparError",
    "ClusterSpec",
    "MixedPrecisionPolicy",
    "Plan",
    "TrainConfig",
    "__version__",
    "checkpoint",
    "compile",
    "data",
    "init_mesh",
]
