"""Checkpoint conversion between backends and layouts (Linen, NNX, scanned, Hugging Face, MaxText)."""
