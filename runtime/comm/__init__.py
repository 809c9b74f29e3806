"""Communication: each mesh axis's process group, autograd-aware collectives and collectives in flight,
local shard arithmetic, and the tensor-parallel ops that fuse a collective with their compute."""

from autopar._moved import forward

__getattr__ = forward(__name__)  # the names of autopar 0.1's autopar.runtime.comm module, deprecated
