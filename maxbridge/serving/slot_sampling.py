"""Sampling per decode slot, for a server whose requests each ask their own (`SlotSampling`), and the scores of
tokens a slot or a prompt produced (`score_tokens`): what `mb.Engine.generate(..., sampling=)` and the server's
scheduler apply to each slot's logits."""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxbridge.ops import sampling as sampling_ops


class SlotSampling(NamedTuple):
  """Each slot's own sampling (`generate(..., sampling=)`), for a server whose requests each ask their own.

  A slot's draw at position p is keyed by fold_in(key(seed), p): on the
  device, with no key split on the host between steps, and a seeded request
  draws the same tokens whichever slot it lands in.
  """

  temperature: jax.Array  # float32 [slots]; 0 is greedy
  top_k: jax.Array  # int32 [slots]; 0 keeps every token
  top_p: jax.Array  # float32 [slots]; 1 keeps every token
  seed: jax.Array  # uint32 [slots]
  # OpenAI's penalties and logit_bias (`sampling_ops.penalize_rows`); None, or zeros: none.
  presence: jax.Array | None = None  # float32 [slots]
  frequency: jax.Array | None = None  # float32 [slots]
  bias_ids: jax.Array | None = None  # int32 [slots, MAX_LOGIT_BIAS]
  bias_values: jax.Array | None = None  # float32 [slots, MAX_LOGIT_BIAS]; 0 where a slot has fewer


MAX_LOGIT_BIAS = 300  # entries of one request's logit_bias (OpenAI's limit): one compiled shape serves all


def sample_slots(
    logits: jax.Array, sampling: SlotSampling, positions: jax.Array, counts: jax.Array | None = None
) -> jax.Array:
  """logits [B, V] -> int32 [B], row b by sampling's row b, keyed by its seed and positions[b].

  With penalties or bias in `sampling`, from the logits they adjust, by the tokens each row generated so far
  (`counts` [B, V]; None: none yet, a request's first token).
  """
  if sampling.presence is not None:
    logits = sampling_ops.penalize_rows(
        logits, counts, sampling.presence, sampling.frequency, sampling.bias_ids, sampling.bias_values
    )
  keys = jax.vmap(lambda seed, pos: jax.random.fold_in(jax.random.key(seed), pos))(sampling.seed, positions)
  return sampling_ops.sample_rows(logits, keys, sampling.temperature, sampling.top_k, sampling.top_p)


def score_tokens(logits: jax.Array, tokens: jax.Array, top: int):
  """logits [N, V] and the tokens that followed them [N] -> (each token's float32 log-probability [N], the `top`
  largest log-probabilities [N, top] and their ids [N, top])."""
  logprobs = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
  values, ids = jax.lax.top_k(logprobs, min(top, logprobs.shape[-1]))
  return jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0], values, ids
