"""The output head: final norm, then the projection to the vocabulary, in float32.

One function for every caller: both backends' decoders call it with their own
norm and projection modules, and the tiled loss (`maxbridge.vocab_tiling`) calls
it with the same math bound to canonical parameters, so the two can never drift.
"""

from typing import Callable

import jax
import jax.numpy as jnp

from maxbridge.core import sharding


def output_logits(x: jax.Array, *, norm: Callable[[jax.Array], jax.Array], project: Callable[[jax.Array], jax.Array]):
  """Hidden states [..., D] -> float32 logits [..., V]."""
  with jax.named_scope("output_head"):
    logits = project(norm(x)).astype(jnp.float32)
    if logits.ndim == 3:
      logits = sharding.constrain(logits, ("activation_batch", "activation_length", "activation_vocab"))
    return logits
