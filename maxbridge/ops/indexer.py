"""DeepSeek-V3.2's lightning indexer (DeepSeek Sparse Attention): each query keeps only its top-k keys for MLA.

The indexer scores every visible key with its own small projections: queries
[T, H, D] from MLA's normed low-rank query, one key [S, D] per token, and a
weight per query head and token. A key's score is
sum_h w[t, h] / sqrt(H) * relu(q[t, h] . k[s] / sqrt(D)), as transformers'
DeepseekV32Indexer computes it (in float32; DeepSeek's fp8 kernel and Hadamard
rotation preserve these dot products). The `indexer_topk` best visible keys of
each query stay in MLA's mask; a query that sees fewer keeps all it sees. The
selection is discrete: no gradient flows through it into the indexer (which
DeepSeek trains by its own distillation loss, not built here).
"""

import jax
import jax.numpy as jnp

from maxbridge.ops import mla, rotary
from maxbridge.ops.attention_mask import attention_mask


def rope(x: jax.Array, positions: jax.Array, config) -> jax.Array:
  """x [B, T, N, D] with its first qk_rope_head_dim dims turned: MLA's frequencies (and YaRN), but in halves,
  not interleaved pairs (transformers' `apply_rotary_pos_emb`; the indexer's weights are laid out so)."""
  rope_part, rest = jnp.split(x, [config.qk_rope_head_dim], axis=-1)
  rope_part = rotary.apply_rotary(rope_part, positions, interleave=False, **mla.rope(config))
  return jnp.concatenate([rope_part, rest], axis=-1)


def scores(query: jax.Array, keys: tuple[jax.Array, ...], weights: jax.Array) -> jax.Array:
  """query [B, T, H, D], key blocks [B, S_i, D] of one sequence (a decode cache's and the new tokens'), weights
  [B, T, H] -> float32 scores [B, T, S], S = sum(S_i)."""
  heads, head_dim = query.shape[-2:]
  query = query.astype(jnp.float32)
  weights = weights.astype(jnp.float32) * heads**-0.5
  per_block = [jax.nn.relu(jnp.einsum("BTHD,BSD->BTHS", query, key.astype(jnp.float32)) * head_dim**-0.5) for key in keys]
  return jnp.einsum("BTH,BTHS->BTS", weights, jnp.concatenate(per_block, axis=-1))


def top_k_keys(index_scores: jax.Array, visible: jax.Array, top_k: int) -> jax.Array:
  """Scores [B, T, S] and the attention mask [B, T, S] -> the keys [B, T, S] each query keeps: its `top_k` best
  visible ones (all visible ones where it sees fewer).

  Kept by a threshold, the k-th best score, not by scattering indices: the same keys but where two visible
  scores tie at the threshold (both kept; torch's topk keeps either), and no scatter to shard.
  """
  index_scores = jax.lax.stop_gradient(jnp.where(visible, index_scores, -jnp.inf))
  top_k = min(top_k, index_scores.shape[-1])
  kth = jax.lax.top_k(index_scores, top_k)[0][..., -1:]
  return visible & (index_scores >= kth)


def chosen_keys(
    index_scores: jax.Array, positions: jax.Array, segment_ids: jax.Array, kv: dict[str, jax.Array], top_k: int
) -> jax.Array:
  """`top_k_keys` among the keys the attention mask lets each query see: the queries' positions and segment ids
  [B, T], the keys' in `kv` while decoding (`kv_positions`, `kv_segment_ids`), else the queries' own."""
  visible = attention_mask(
      segment_ids, kv.get("kv_segment_ids", segment_ids), positions, kv.get("kv_positions", positions)
  )[:, 0, 0]
  return top_k_keys(index_scores, visible, top_k)
