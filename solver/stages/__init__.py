"""Pipeline stage balance: contiguous runs of a split's subgraphs onto stages, their time and memory, the
stage plan."""
