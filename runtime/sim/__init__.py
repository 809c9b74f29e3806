"""The single-process rank simulator: every rank of a mesh in a thread of one process, its process groups,
and sharded values to and from whole ones."""
