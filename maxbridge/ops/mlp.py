"""Gated MLP activation: silu(x wi_0) * (x wi_1), the inside of wo(...)."""

import jax
import jax.numpy as jnp

from maxbridge.core import sharding


def silu_gate(gate: jax.Array, up: jax.Array) -> jax.Array:
  hidden = jax.nn.silu(gate) * up
  return sharding.constrain(hidden, ("activation_batch", "activation_length", "activation_mlp"))


def gelu_gate(gate: jax.Array, up: jax.Array) -> jax.Array:
  """GeGLU (Gemma): gelu_tanh(x wi_0) * (x wi_1)."""
  hidden = gelu_tanh(gate) * up
  return sharding.constrain(hidden, ("activation_batch", "activation_length", "activation_mlp"))


def gelu_tanh(x: jax.Array) -> jax.Array:
  """GELU with the tanh approximation (GPT-2's "gelu_new", MaxText's "gelu")."""
  return jax.nn.gelu(x, approximate=True)


def clamped_swiglu(gate_up: jax.Array, *, alpha: float, limit: float) -> jax.Array:
  """gpt-oss's expert activation of the fused projection [..., 2F], gate and up interleaved (gate at even columns).

  The gate is clamped above at `limit`, the up projection to [-limit, limit];
  then (up + 1) * gate * sigmoid(alpha * gate), as transformers' GptOssExperts.
  """
  gate, up = gate_up[..., 0::2], gate_up[..., 1::2]
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return (up + 1) * gate * jax.nn.sigmoid(alpha * gate)
