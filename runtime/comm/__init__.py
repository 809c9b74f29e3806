"""Communication: each mesh axis's process group, autograd-aware collectives and collectives in flight,
local shard arithmetic, and the tensor-parallel ops that fuse a collective with their compute."""
