"""The intra-operator sharding problem: candidates and rules per op, the cost model, the ILP and its
presolve, the baselines, the memory prediction."""
