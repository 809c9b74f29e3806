"""Compiler passes over the autopar IR: capture, lowering, sharding, collectives, codegen."""
