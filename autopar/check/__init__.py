"""Checking plans numerically: one float64 training step of every simulated rank against the model, each
op's strategies against the unsharded op, and scaled-down copies of large models."""
