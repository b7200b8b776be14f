"""cuDNN flash attention (`jax.nn.dot_product_attention(implementation="cudnn")`): `attention=flash` on a GPU.

cuDNN skips the blocks above the causal diagonal and outside a sliding window; what else maxbridge's mask says
(documents, Llama 4's chunks: `ops.attention_mask`, by position) joins as a boolean mask, which JAX turns into
a bias. Soft caps, sinks, a value width unlike the key's (MLA) and QK-Clip's max logits are refused by name.
"""

import jax

from maxbridge.core import sharding
from maxbridge.ops.attention_mask import attention_mask

# jax.nn.dot_product_attention's implementation. Tests set "xla" to check on the CPU what the arguments mean.
IMPLEMENTATION = "cudnn"


def unsupported(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    return_max_logits: bool = False,
    logits_soft_cap: float = 0.0,
    sinks: jax.Array | None = None,
    **_,
) -> str | None:
  """What cuDNN's kernel cannot do for these arguments (`ops.attention`'s kernel keywords), or None."""
  if sharding.axis_size("context") > 1:
    return "gather keys and values over the context axis (context parallelism): set ici_context_parallelism=1"
  if return_max_logits:
    return "return QK-Clip's per-head max logits (use_qk_clip=true)"
  if logits_soft_cap:
    return f"soft-cap the attention logits (attn_logits_soft_cap={logits_soft_cap})"
  if sinks is not None:
    return "add attention sinks (gpt-oss)"
  if value.shape[-1] != key.shape[-1]:
    return f"read values {value.shape[-1]} wide with keys {key.shape[-1]} wide (MLA's v_head_dim)"
  return None


def cudnn_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    sliding_window_size: int = 0,
    chunk_size: int = 0,
    query_scale: float | None = None,
    return_max_logits: bool = False,
    logits_soft_cap: float = 0.0,
    sinks: jax.Array | None = None,
) -> jax.Array:
  """`ops.attention.dot_product_attention`'s arguments and result for self-attention (query [B, T, N, H], key
  and value [B, T, K, H] -> [B, T, N, H])."""
  reason = unsupported(
      query, key, value, return_max_logits=return_max_logits, logits_soft_cap=logits_soft_cap, sinks=sinks
  )
  if reason:
    raise ValueError(f"attention=flash on a GPU (cuDNN) cannot {reason}; or set attention=dot_product")
  mask = attention_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, sliding_window_size, chunk_size)
  with jax.named_scope("cudnn_attention"):
    out = jax.nn.dot_product_attention(
        query,
        key,
        value,
        mask=mask[:, 0],  # [B, 1, T, S]: one mask for every head
        scale=1.0 if query_scale is None else query_scale,  # Llama's 1/sqrt(H) is in the query kernel
        is_causal=True,
        local_window_size=(sliding_window_size - 1, 0) if sliding_window_size else None,
        implementation=IMPLEMENTATION,
    )
    return sharding.constrain(
        out.astype(value.dtype), ("activation_batch", "activation_length", "activation_heads", "activation_kv")
    )
