"""Flax Linen decoder families. Mirrors nnx_models/ file for file."""
