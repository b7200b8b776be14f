"""Gemma 4's router and experts: a normed, scaled router input, softmax top-k, a learned scale per expert.

transformers' Gemma4TextRouter: the router reads RMSNorm(x) (no scale of its
own) x `scale` / sqrt(D), takes the softmax over all experts, keeps the top k
renormalised to sum to 1, and multiplies each kept weight by its expert's
`per_expert_scale`. The experts are GeGLU MLPs (GELU's tanh approximation).
"""

import jax
import jax.numpy as jnp

from maxbridge.ops import linear, moe, normalization


def scaled_router(
    x: jax.Array,
    scale: jax.Array,
    kernel: jax.Array,
    per_expert_scale: jax.Array,
    *,
    k: int,
    epsilon: float,
    dot_general: linear.DotGeneral = jax.lax.dot_general,
) -> tuple[jax.Array, jax.Array]:
  """x [..., D], scale [D], kernel [D, E], per_expert_scale [E] -> (weights [..., K] float32, expert indices [..., K])."""
  width = x.shape[-1]
  with jax.named_scope("scaled_router"):
    normed = normalization.rms_norm(x, jnp.ones((width,), x.dtype), epsilon=epsilon, dtype=x.dtype)
    routed = normed * scale.astype(x.dtype) * width**-0.5
    logits = linear.dense_general(routed, kernel, in_ndim=1, dtype=x.dtype, dot_general=dot_general)
    weights, indices = moe.top_k_of_softmax(logits.astype(jnp.float32), k, normalize=True)
    return weights * jnp.take(per_expert_scale.astype(jnp.float32), indices), indices


def scaled_router_moe(
    x: jax.Array,
    router_input: jax.Array,
    scale: jax.Array,
    kernel: jax.Array,
    per_expert_scale: jax.Array,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    *,
    k: int,
    epsilon: float,
    sparse: bool,
    dtype: jnp.dtype,
    dot_general: linear.DotGeneral = jax.lax.dot_general,
    ragged_dot: moe.RaggedDot = moe.lax_ragged_dot,
) -> jax.Array:
  """x [B, T, D] through the experts `router_input` [B, T, D] routes it to -> [B, T, D].

  Gemma 4 routes by the layer's input and sends the experts a differently normed copy of it.
  """
  batch, length, width = x.shape
  # Routed at [B, T, D]: the norm constrains its output as a [batch, length, embed] activation under a mesh.
  weights, indices = scaled_router(
      router_input, scale, kernel, per_expert_scale, k=k, epsilon=epsilon, dot_general=dot_general
  )
  weights, indices = weights.reshape(-1, k), indices.reshape(-1, k)
  gelu = lambda h: jax.nn.gelu(h, approximate=True)  # noqa: E731
  flat = x.reshape(-1, width)
  if sparse:
    out = moe.dropless_experts(
        flat, weights, indices, wi_0, wi_1, wo, dtype=dtype, ragged_dot=ragged_dot, activation=gelu
    )
  else:
    out = moe.dense_experts(flat, weights, indices, wi_0, wi_1, wo, dtype=dtype, dot_general=dot_general, activation=gelu)
  return out.reshape(batch, length, width)
