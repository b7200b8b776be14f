"""Flax NNX decoder families. Mirrors linen_models/ file for file."""
