"""Model presets: the named families and their configs, and MODEL strings resolved into a model and its
example inputs."""
