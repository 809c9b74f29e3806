"""autopar: compiler-style auto-parallelization for PyTorch training."""

from __future__ import annotations

from autopar import data
from autopar.api import compile, init_mesh
from autopar.errors import AutoparError

__version__ = "0.1.0"

__all__ = ["AutoparError", "__version__", "compile", "data", "init_mesh"]
