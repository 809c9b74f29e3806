"""Measuring: this machine for the cost model, the bytes a training step holds, the trace of a step's
actions."""
