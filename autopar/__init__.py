"""autopar: compiler-style auto-parallelization for PyTorch training.

mesh = autopar.init_mesh(dp=2, tp=2)
model = autopar.compile(model, mesh, kwargs=batch, config=autopar.TrainConfig(zero=2))
autopar.checkpoint.save("ckpt", model, opt)
"""

from __future__ import annotations

from autopar import _moved

_moved.install()  # the module paths of autopar 0.1 keep importing, deprecated

from autopar import checkpoint, data  # noqa: E402
from autopar.api import compile, init_mesh  # noqa: E402
from autopar.config import TrainConfig  # noqa: E402
from autopar.errors import AutoparError  # noqa: E402
from autopar.plan import Plan  # noqa: E402
from autopar.runtime.build.precision import MixedPrecisionPolicy  # noqa: E402
from autopar.solver.cluster.spec import ClusterSpec  # noqa: E402

__version__ = "0.1.0"

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
