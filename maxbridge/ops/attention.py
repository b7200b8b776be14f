"""Grouped-query dot-product attention, masked by query and key positions and segments.

The mask is built from positions, not from array indices, so queries and keys
may differ in length and offset (a query block against a cache of keys).
"""

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from maxbridge.core import sharding
from maxbridge.core.families import attention as attention_spec
from maxbridge.core.families.attention import AttentionSpec
from maxbridge.ops import cudnn_attention, flash_attention, proportional_rope, rotary, splash_attention
from maxbridge.ops.attention_mask import MASK_VALUE, attention_mask  # noqa: F401  (ops.attention's names)
from maxbridge.ops.soft_cap import soft_cap


def dot_product_attention(
    query: jax.Array,
    key: jax.Array | tuple[jax.Array, ...],
    value: jax.Array | tuple[jax.Array, ...],
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
    float32_logits: bool = True,
    key_mask: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
  """query [B, T, N, H], key [B, S, K, H], value [B, S, K, Hv] -> [B, T, N, Hv].

  Masked by `attention_mask` of the query [B, T] and key [B, S] segment ids
  and positions. Query head j reads kv head j // (N / K). For Llama the
  1/sqrt(H) factor lives in the query kernel (as in MaxText), so scores are
  not scaled here; families that cannot fold it (`initializers.query_kernel_carries_scale`)
  pass `query_scale`, applied to the query before the product as MaxText does.

  With `return_max_logits`, also returns float32 [N]: each query head's largest
  pre-softmax score over the batch and every visible (query, key) pair, as
  QK-Clip needs it (MuonClip rescales a head's query and key weights by it).
  It carries no gradient.

  `logits_soft_cap` > 0 squashes the scores into (-cap, cap) before the mask (Gemma 2).

  `sinks` [N] (gpt-oss's attention sinks): one more logit per query head that
  joins each row's softmax but reads no value, so a row may give less than
  all of its weight to the keys.

  `key` and `value` may each be a tuple of blocks [B, S_i, K, H] of one
  sequence (a decode cache and the new tokens, `ops.kv_cache.read_first`),
  masked by the segment ids and positions of all S = sum(S_i): each block is
  read where it lies, one product per block, and no [B, S, ...] copy is made.

  `float32_logits` (MaxText's key): the scores, their soft cap and softmax in float32; False keeps them in the
  query's dtype, as MaxText's default does (half the bytes of the [T, S] scores in bfloat16).

  `key_mask` [B, T, S]: the keys each query may read besides the mask's own rule (DeepSeek-V3.2's indexer's
  choice, `ops.indexer`), or None.
  """
  if not isinstance(key, tuple):
    key, value = (key,), (value,)
  batch, length, num_heads, head_dim = query.shape
  num_kv_heads = key[0].shape[2]
  if num_heads % num_kv_heads:
    raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} kv heads")
  with jax.named_scope("dot_product_attention"):
    if sharding.axis_size("context") > 1 and length % sharding.axis_size("context") == 0:  # not a decode step's query
      key, value = jnp.concatenate(key, axis=1), jnp.concatenate(value, axis=1)
      query, key, value, kv_segment_ids, kv_positions = _gather_context(query, key, value, kv_segment_ids, kv_positions)
      key, value = (key,), (value,)
    out, max_logits = _attend(
        query,
        key,
        value,
        q_segment_ids,
        kv_segment_ids,
        q_positions,
        kv_positions,
        sinks,
        key_mask,
        sliding_window_size=sliding_window_size,
        chunk_size=chunk_size,
        query_scale=query_scale,
        logits_soft_cap=logits_soft_cap,
        float32_logits=float32_logits,
    )
    out = sharding.constrain(out, ("activation_batch", "activation_length", "activation_heads", "activation_kv"))
    return (out, max_logits) if return_max_logits else out


# Jitted for its trace: every layer, backend and model that attends with the same shapes and settings reuses one
# traced program, and its derivatives (tracing, not XLA, is most of a small model's compile). What reads the active
# mesh (`sharding`) stays outside, where a cached trace cannot go stale.
@functools.partial(
    jax.jit, static_argnames=("sliding_window_size", "chunk_size", "query_scale", "logits_soft_cap", "float32_logits")
)
def _attend(
    query,
    key,
    value,
    q_segment_ids,
    kv_segment_ids,
    q_positions,
    kv_positions,
    sinks,
    key_mask,
    *,
    sliding_window_size,
    chunk_size,
    query_scale,
    logits_soft_cap,
    float32_logits,
):
  batch, length, num_heads, head_dim = query.shape
  num_kv_heads = key[0].shape[2]
  if query_scale is not None:
    query = query * jnp.asarray(query_scale, query.dtype)
  query = query.reshape(batch, length, num_kv_heads, num_heads // num_kv_heads, head_dim)
  # Batch and head axes first in every product (query [B, K, G, T, H], keys
  # and values [B, K, S, H]), as a decode cache stores them (`ops.kv_cache`,
  # keys transposed): it is then read where it lies, not copied.
  query = query.transpose(0, 2, 3, 1, 4)
  key, value = [jnp.moveaxis(k, 1, 2) for k in key], [jnp.moveaxis(v, 1, 2) for v in value]
  scores = [jnp.einsum("BKGTH,BKSH->BKGTS", query, k) for k in key]
  scores = [s.astype(jnp.float32) for s in scores] if float32_logits else scores
  scores = jnp.concatenate(scores, axis=-1)
  scores = soft_cap(scores, logits_soft_cap)
  mask = attention_mask(q_segment_ids, kv_segment_ids, q_positions, kv_positions, sliding_window_size, chunk_size)
  if key_mask is not None:
    mask &= key_mask[:, None, None]
  scores = jnp.where(mask, scores, MASK_VALUE)
  weights = softmax_with_sinks(scores, sinks).astype(value[0].dtype)
  starts = np.cumsum([v.shape[2] for v in value])[:-1]
  out = [jnp.einsum("BKGTS,BKSH->BKGTH", w, v) for w, v in zip(jnp.split(weights, starts, axis=-1), value)]
  out = sum(out[1:], out[0])
  out = out.transpose(0, 3, 1, 2, 4).reshape(batch, length, num_heads, value[0].shape[-1])
  # Masked scores are MASK_VALUE already, below any real one; a head whose
  # every pair is masked reports MASK_VALUE.
  max_logits = jnp.max(jax.lax.stop_gradient(scores), axis=(0, 3, 4)).reshape(num_heads).astype(jnp.float32)
  return out, max_logits


def _gather_context(query, key, value, kv_segment_ids, kv_positions):
  """Context parallelism, MaxText's all_gather strategy: each device keeps its slice of the sequence's queries
  and reads every key and value, gathered over "context" by the partitioner.

  The mask needs nothing more: it is built from the keys' own (global) positions and segment ids, gathered with
  them, so causality, documents and sliding windows hold across the slices. Heads are left to the partitioner.
  """
  free = PartitionSpec.UNCONSTRAINED
  query = sharding.constrain(query, ("activation_batch", "activation_q_length", free, free))
  key, value = (sharding.constrain(x, ("activation_batch", "activation_kv_length", free, free)) for x in (key, value))
  kv_segment_ids, kv_positions = (
      sharding.constrain(x, ("activation_batch", "activation_kv_length")) for x in (kv_segment_ids, kv_positions)
  )
  return query, key, value, kv_segment_ids, kv_positions


def softmax_with_sinks(scores: jax.Array, sinks: jax.Array | None) -> jax.Array:
  """Softmax of scores [B, K, G, T, S] over S, with per-head sink logits [K * G] in each denominator (or none)."""
  if sinks is None:
    return jax.nn.softmax(scores, axis=-1)
  sink = jnp.broadcast_to(sinks.astype(scores.dtype).reshape(1, *scores.shape[1:3], 1, 1), (*scores.shape[:-1], 1))
  return jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]


# The config's `attention` key -> the kernel that computes `dot_product_attention`'s result on a CPU. "flash" is
# the blockwise kernel (`ops.flash_attention`), which builds the same mask (`ops.attention_mask`) per block.
KERNELS = {
    "dot_product": dot_product_attention,
    "autoselected": dot_product_attention,
    "flash": flash_attention.flash_attention,
}
# Each accelerator's flash kernel: (module, with `unsupported`, the kernel).
ACCELERATED = {
    "tpu": (splash_attention, splash_attention.splash_attention),
    "gpu": (cudnn_attention, cudnn_attention.cudnn_attention),
}
# MaxText's autoselected reads dot_product below this many queries: a kernel's blocks would be mostly padding.
MIN_KERNEL_LENGTH = 128


def choose_kernel(
    name: str, platform: str, *, float32_logits: bool = True, splash_blocks: splash_attention.Blocks | None = None
) -> Callable[..., jax.Array]:
  """The config's `attention` name on the platform a step is compiled for (`sharding.platform`) -> the kernel,
  called with `dot_product_attention`'s arguments: the one place a kernel is chosen.

  dot_product is always the einsum. flash is Pallas splash attention on a TPU, cuDNN's on a GPU, the blockwise
  kernel elsewhere; an accelerator's refuses what it cannot express, naming it. autoselected, as MaxText's: the
  accelerator's kernel where it applies (at least `MIN_KERNEL_LENGTH` queries, nothing it refuses), else
  dot_product, and dot_product on a CPU. A decode step (a short query against a cache) reads dot_product on an
  accelerator, as MaxText's does. `float32_logits` is dot_product's; `splash_blocks`, splash's block sizes.
  """
  dot_product = functools.partial(KERNELS["dot_product"], float32_logits=float32_logits)
  if name == "dot_product" or (name == "autoselected" and platform not in ACCELERATED):
    return dot_product
  if platform not in ACCELERATED:
    return KERNELS[name]
  module, kernel = ACCELERATED[platform]
  if module is splash_attention and splash_blocks is not None:
    kernel = functools.partial(kernel, blocks=splash_blocks)

  def accelerated(query, key, value, **options):
    if isinstance(key, tuple) and len(key) == 1:  # no cache: the layer's own keys
      key, value = key[0], value[0]
    if isinstance(key, tuple) or key.shape[1] != query.shape[1]:
      return dot_product(query, key, value, **options)
    if name == "autoselected" and (
        query.shape[1] < MIN_KERNEL_LENGTH or module.unsupported(query, key, value, **options)
    ):
      return dot_product(query, key, value, **options)
    return kernel(query, key, value, **options)

  return accelerated


def self_attention(
    query: jax.Array,
    key: jax.Array | tuple[jax.Array, ...],
    value: jax.Array | tuple[jax.Array, ...],
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    kernel: str = "dot_product",
    sliding_window_size: int = 0,
    chunk_size: int = 0,
    query_scale: float | None = None,
    with_max_logits: bool = False,
    logits_soft_cap: float = 0.0,
    sinks: jax.Array | None = None,
    kv_segment_ids: jax.Array | None = None,
    kv_positions: jax.Array | None = None,
    float32_logits: bool = True,
    splash_blocks: splash_attention.Blocks | None = None,
    key_mask: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Attention of a sequence over itself: (output, the per-layer values a decoder layer returns).

  While decoding, keys and values are a cache's (and the new tokens', as blocks)
  and carry their own `kv_segment_ids` and `kv_positions` [B, S] (`ops.kv_cache`); by default
  they are the queries'. The values hold the per-head max logits
  (`decoder/max_logits`) when QK-Clip asks for them. `kernel`: the config's `attention`, chosen for the platform
  the step is compiled for (`choose_kernel`), with its options (`kernel_options`). A `key_mask` (the indexer's
  choice of keys) is read by the dot-product kernel whatever `kernel` says: the blockwise kernels build their
  masks from positions alone.
  """
  if key_mask is None:
    attend = choose_kernel(kernel, sharding.platform(), float32_logits=float32_logits, splash_blocks=splash_blocks)
  else:
    attend = functools.partial(dot_product_attention, float32_logits=float32_logits, key_mask=key_mask)
  result = attend(
      query,
      key,
      value,
      q_segment_ids=segment_ids,
      kv_segment_ids=segment_ids if kv_segment_ids is None else kv_segment_ids,
      q_positions=positions,
      kv_positions=positions if kv_positions is None else kv_positions,
      sliding_window_size=sliding_window_size,
      chunk_size=chunk_size,
      query_scale=query_scale,
      return_max_logits=with_max_logits,
      logits_soft_cap=logits_soft_cap,
      sinks=sinks,
  )
  if with_max_logits:
    out, max_logits = result
    return out, {"max_logits": max_logits}
  return result, {}


def layer_attention(
    spec: AttentionSpec,
    config,
    query: jax.Array,
    key: jax.Array | tuple[jax.Array, ...],
    value: jax.Array | tuple[jax.Array, ...],
    segment_ids: jax.Array,
    positions: jax.Array,
    *,
    sinks: jax.Array | None = None,
    **masking: jax.Array,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`self_attention` as a layer's spec and the config set it: the kernel (`attention`, `float32_logits`), window
  or chunk, query scale, soft cap and QK-Clip's max logits; `masking`, a decode cache's keywords (`ops.kv_cache`)."""
  return self_attention(
      query,
      key,
      value,
      segment_ids,
      positions,
      sliding_window_size=spec.sliding_window_size,
      chunk_size=spec.chunk_size,
      query_scale=spec.query_scale,
      with_max_logits=config.use_qk_clip,
      logits_soft_cap=spec.logits_soft_cap,
      sinks=sinks,
      **kernel_options(config),
      **masking,
  )


def kernel_options(config) -> dict[str, Any]:
  """`self_attention`'s keywords the config sets for any attention layer: the kernel (MaxText's `attention`),
  dot_product's `float32_logits` and splash's block sizes (its `sa_*` keys)."""
  return dict(
      # Images' bidirectional groups ride in the segment ids (`ops.vision.with_image_groups`), which only the
      # einsum's mask is known to read: a model with a vision tower attends with dot_product.
      kernel="dot_product" if config.use_multimodal else config.attention,
      float32_logits=config.float32_logits,
      splash_blocks=splash_attention.Blocks.of_config(config),
  )


# The per-layer value holding an attention layer's output after its out projection [B, T, emb_dim]: what
# MaxText's feature distillation compares (its attention sows it under this name when distill_beta > 0).
OUT_PROJECTION = "out_projection_activations"


# The per-layer value holding what a layer whose keys and values later layers read attended over (Gemma 4's KV
# sharing): its keys, values and the keywords that mask them, a cache's while decoding.
ATTENDED = "attended_kv"
SharedKV = tuple[jax.Array, jax.Array, dict[str, jax.Array]]


def with_out_projection(config, projected: jax.Array, values: dict[str, jax.Array]):
  """(projected, `values` plus `OUT_PROJECTION` when distill_beta > 0): what every attention layer returns.

  The one place that decides this capture, as MaxText's switch does: only a
  run whose loss reads the activations pays for stacking them over the layers.
  """
  if config.distill_beta > 0:
    return projected, {**values, OUT_PROJECTION: projected}
  return projected, values


def temperature_tuning(positions: jax.Array, scale: float, floor_scale: float) -> jax.Array:
  """Llama 4's query temperature on its NoPE layers: positions [B, T] -> factors [B, T, 1, 1] (float32).

  1 + scale * log(1 + floor((pos + 1) / floor_scale)), as Hugging Face's
  Llama4TextAttention (attn_scale, floor_scale): queries far into a long
  sequence are sharpened, which keeps attention without positions from
  flattening as the number of keys grows.
  """
  steps = jnp.floor((positions.astype(jnp.float32) + 1.0) / floor_scale)
  return (jnp.log1p(steps) * scale + 1.0)[:, :, None, None]


def l2_norm(x: jax.Array, epsilon: float) -> jax.Array:
  """x * rsqrt(mean(x^2) + eps) over the last axis, in float32, without a learned scale (Llama 4's QK-norm)."""
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + epsilon)).astype(x.dtype)


def turn(
    spec: AttentionSpec, config, query: jax.Array, key: jax.Array | None, positions: jax.Array
) -> tuple[jax.Array, jax.Array | None]:
  """Queries [B, T, N, H] and keys [B, T, K, H] (None: an earlier layer's, turned already) as `spec` turns them.

  RoPE of `spec.rope`'s kind, then the L2 QK-norm where the spec has it (Llama 4
  normalises after RoPE), then a NoPE layer's temperature on the queries.
  """
  query = _rotate(spec, config, query, positions)
  key = None if key is None else _rotate(spec, config, key, positions)
  if spec.qk_norm == attention_spec.L2:
    query = l2_norm(query, config.normalization_layer_epsilon)
    key = None if key is None else l2_norm(key, config.normalization_layer_epsilon)
  if spec.temperature_tuning:
    factor = temperature_tuning(positions, config.temperature_tuning_scale, config.temperature_tuning_floor_scale)
    query = (query * factor).astype(query.dtype)
  return query, key


def _rotate(spec: AttentionSpec, config, x: jax.Array, positions: jax.Array) -> jax.Array:
  if spec.rope == attention_spec.NO_ROPE:
    return x
  if spec.rope == attention_spec.PARTIAL_ROPE:
    return rotary.apply_partial_rotary(x, positions, rotary_dim=spec.rotary_dim, max_timescale=config.rope_max_timescale)
  if spec.rope == attention_spec.PROPORTIONAL_ROPE:
    return proportional_rope.apply_proportional_rotary(
        x, positions, pairs=spec.rotary_pairs, max_timescale=config.rope_max_timescale
    )
  interleave = spec.rope == attention_spec.INTERLEAVED_ROPE
  layer_rope = rotary.layer_rope(config, local=spec.rope == attention_spec.LOCAL_ROPE)
  return rotary.apply_rotary(x, positions, interleave=interleave, **layer_rope)
