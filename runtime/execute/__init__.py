"""Executing a rank's pipeline action list: the executor, its point-to-point traffic and bookkeeping,
backwards split into B and W, sub-pipelined tensor parallelism."""
