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
