"""Strategy search: sharding (rules, cost model, ILP, baselines), stages (pipeline balance), cluster
(specs, units, presets)."""
