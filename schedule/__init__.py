"""Pipeline schedules as data, the layer beneath the solver: action lists, their generators and the one
registry, zero-bubble and list scheduling, the simulator, action costs, the papers' formulas, charts."""
