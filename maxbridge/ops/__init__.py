"""Shared numerics: every backend calls these pure functions, in the same order."""

from maxbridge.ops import attention, embedding, linear, losses, mlp, normalization, remat, rotary

__all__ = ["attention", "embedding", "linear", "losses", "mlp", "normalization", "remat", "rotary"]
