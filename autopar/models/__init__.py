"""Model presets: the named families and their configs, and MODEL strings resolved into a model and its
example inputs."""

from autopar._moved import forward

__getattr__ = forward(__name__)  # the names of autopar 0.1's autopar.models module, deprecated
