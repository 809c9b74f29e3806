"""Cluster specs: nodes, devices, memory, FLOP/s and links, the units they are written in, the presets,
and collectives priced on them (alpha-beta)."""
