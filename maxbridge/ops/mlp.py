"""Gated MLP activation: silu(x wi_0) * (x wi_1), the inside of wo(...)."""
import jax


def silu_gate(gate: jax.Array, up: jax.Array) -> jax.Array:
  return jax.nn.silu(gate) * up
