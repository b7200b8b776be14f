"""Choosing the next token from logits: MaxText's decode sampling strategies."""

import jax
import jax.numpy as jnp

STRATEGIES = ("greedy", "weighted", "topk", "nucleus")


def sample(
    logits: jax.Array,
    key: jax.Array,
    *,
    strategy: str,
    temperature: float = 1.0,
    top_k: int = 0,
    nucleus_p: float = 1.0,
) -> jax.Array:
  """logits [..., V] -> int32 tokens [...].

  greedy: argmax. weighted: a draw from softmax(logits / temperature). topk:
  the same among the `top_k` largest logits. nucleus: among the fewest most
  likely tokens whose probability reaches `nucleus_p`.
  """
  if strategy == "greedy":
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)
  if strategy not in STRATEGIES:
    raise ValueError(f"decode_sampling_strategy must be one of {STRATEGIES}, got {strategy!r}")
  logits = logits.astype(jnp.float32) / temperature
  if strategy == "topk":
    if not 0 < top_k <= logits.shape[-1]:
      raise ValueError(
          f"decode_sampling_strategy='topk' needs decode_sampling_top_k in [1, vocab_size={logits.shape[-1]}], "
          f"got {top_k}"
      )
    kth = jax.lax.top_k(logits, top_k)[0][..., -1:]
    logits = jnp.where(logits >= kth, logits, -jnp.inf)
  elif strategy == "nucleus":
    if not 0 < nucleus_p <= 1:
      raise ValueError(f"decode_sampling_strategy='nucleus' needs decode_sampling_nucleus_p in (0, 1], got {nucleus_p}")
    ordered = jnp.sort(logits, axis=-1)[..., ::-1]
    cumulative = jnp.cumsum(jax.nn.softmax(ordered, axis=-1), axis=-1)
    # The smallest logit still needed: the first whose cumulative probability reaches p.
    needed = jnp.minimum(jnp.sum(cumulative < nucleus_p, axis=-1, keepdims=True), logits.shape[-1] - 1)
    cutoff = jnp.take_along_axis(ordered, needed, axis=-1)
    logits = jnp.where(logits >= cutoff, logits, -jnp.inf)
  return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def sample_rows(
    logits: jax.Array, keys: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array
) -> jax.Array:
  """logits [B, V] -> int32 [B], each row by its own settings (a server's requests each ask their own).

  Row b: argmax where temperature[b] == 0; else a draw with keys[b] from
  softmax(logits / temperature) among its top_k[b] most likely tokens (0: all),
  then among the fewest of those holding top_p[b] of their probability (1: all),
  top-k before top-p as Hugging Face and vLLM apply them. When every row is
  greedy the sort is skipped (`lax.cond`), so a greedy step pays for argmax alone.
  """
  logits = logits.astype(jnp.float32)
  greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
  vocab = logits.shape[-1]

  def draw(logits):
    scaled = logits / jnp.where(temperature > 0, temperature, 1.0)[:, None]
    ordered = jnp.sort(scaled, axis=-1)[:, ::-1]
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)[:, None]
    kept = jnp.where(jnp.arange(vocab)[None] < k, ordered, -jnp.inf)
    cumulative = jnp.cumsum(jax.nn.softmax(kept, axis=-1), axis=-1)
    # The smallest logit kept: the first whose cumulative probability reaches top_p, never past the k-th.
    needed = jnp.minimum(jnp.sum(cumulative < top_p[:, None], axis=-1, keepdims=True), k - 1)
    cutoff = jnp.take_along_axis(ordered, needed, axis=-1)
    masked = jnp.where(scaled >= cutoff, scaled, -jnp.inf)
    drawn = jax.vmap(lambda key, row: jax.random.categorical(key, row))(keys, masked).astype(jnp.int32)
    return jnp.where(temperature > 0, drawn, greedy)

  return jax.lax.cond(jnp.any(temperature > 0), draw, lambda _: greedy, logits)


def penalize_rows(
    logits: jax.Array,
    counts: jax.Array | None,
    presence: jax.Array,
    frequency: jax.Array,
    bias_ids: jax.Array,
    bias_values: jax.Array,
) -> jax.Array:
  """logits [B, V] -> float32 [B, V] with OpenAI's logit_bias, presence_penalty and frequency_penalty, row b by its own.

  Row b: logits + bias_values[b] at bias_ids[b] (pad with value 0), minus
  presence[b] where counts[b] > 0 and frequency[b] * counts[b]; counts [B, V]
  are the tokens row b generated so far (None: none yet). When no row asks
  for any of them the arithmetic is skipped (`lax.cond`): a step of plain
  requests pays for one reduction over the settings, not a pass over [B, V].
  """
  logits = logits.astype(jnp.float32)

  def adjust(logits):
    if counts is not None:
      seen = counts.astype(jnp.float32)
      logits = logits - presence[:, None] * (seen > 0) - frequency[:, None] * seen
    return logits.at[jnp.arange(logits.shape[0])[:, None], bias_ids].add(bias_values)

  active = jnp.any(bias_values != 0)
  if counts is not None:
    active |= jnp.any(presence != 0) | jnp.any(frequency != 0)
  return jax.lax.cond(active, adjust, lambda logits: logits, logits)
