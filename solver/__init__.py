"""Strategy search: cost model, ILP construction and solving, baselines, explanations."""
