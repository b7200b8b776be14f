"""Gated MLP activation: silu(x wi_0) * (x wi_1), the inside of wo(...)."""

import jax

from maxbridge.core import sharding


def silu_gate(gate: jax.Array, up: jax.Array) -> jax.Array:
  hidden = jax.nn.silu(gate) * up
  return sharding.constrain(hidden, ("activation_batch", "activation_length", "activation_mlp"))


def gelu_tanh(x: jax.Array) -> jax.Array:
  """GELU with the tanh approximation (GPT-2's "gelu_new", MaxText's "gelu")."""
  return jax.nn.gelu(x, approximate=True)
