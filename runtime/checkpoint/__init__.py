"""Checkpoints: save on one mesh and resume on any other (DCP), the files on disk, pieces of tensors, the
whole model exported (state dict, safetensors)."""
