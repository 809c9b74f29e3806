"""Building a rank's programs: codegen of GraphModules, the pipeline stages, parameters and their
initialization, mesh-invariant dropout, mixed precision."""
