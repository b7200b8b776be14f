"""The output head: final norm, then the projection to the vocabulary (tied or untied), in float32.

One function for every caller: both backends' decoders call it with their own
norm and dense modules (which hold the parameters and the matmul settings),
and the tiled loss (`maxbridge.training.vocab_tiling`) with the same math bound
to canonical parameters (`final_norm`), so the three can never drift.
"""

import functools
from typing import Callable, Mapping

import jax
import jax.numpy as jnp

from maxbridge.core import sharding
from maxbridge.ops import embedding as embedding_ops
from maxbridge.ops import linear, normalization
from maxbridge.ops.soft_cap import soft_cap


def output_logits(
    x: jax.Array,
    *,
    norm: Callable[[jax.Array], jax.Array],
    project: Callable[[jax.Array], jax.Array] | None = None,
    embedding: jax.Array | None = None,
    dtype: jnp.dtype = jnp.float32,
    dot_general: linear.DotGeneral = jax.lax.dot_general,
    normalize_embedding_logits: bool = False,
    final_logits_soft_cap: float = 0.0,
) -> jax.Array:
  """Hidden states [..., D] -> float32 logits [..., V]: `norm`, then the untied `project` or the tied `embedding`.

  Untied: `project` is the caller's dense layer [D, V]. Tied: `embedding` is
  the token table [V, D], whose transpose projects, by `dot_general` in `dtype`,
  and (`normalize_embedding_logits`, MaxText's key) the logits are divided by
  sqrt(D). `final_logits_soft_cap` > 0 then squashes them into (-cap, cap) (Gemma 2).
  """
  if (project is None) == (embedding is None):
    raise ValueError("output_logits: pass `project` (an untied head) or `embedding` (a tied one), exactly one")
  with jax.named_scope("output_head"):
    x = norm(x)
    if embedding is None:
      logits = project(x)
    else:
      logits = embedding_ops.attend(x, embedding, dtype=dtype, dot_general=dot_general)
      if normalize_embedding_logits:
        logits = logits / jnp.sqrt(jnp.asarray(x.shape[-1], logits.dtype))
    logits = soft_cap(logits.astype(jnp.float32), final_logits_soft_cap)
    if logits.ndim == 3:
      logits = sharding.constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))
    return logits


def final_norm(
    kind: str, params: Mapping[str, jax.Array], *, epsilon: float, dtype: jnp.dtype
) -> Callable[[jax.Array], jax.Array]:
  """The final norm bound to its parameters (`scale`, and `bias` for "layer_norm"): what the norm modules compute."""
  if kind == "layer_norm":
    return functools.partial(
        normalization.layer_norm, scale=params["scale"], bias=params["bias"], epsilon=epsilon, dtype=dtype
    )
  rms_norm = normalization.zero_centred_rms_norm if kind == "zero_centred_rms_norm" else normalization.rms_norm
  return functools.partial(rms_norm, scale=params["scale"], epsilon=epsilon, dtype=dtype)
