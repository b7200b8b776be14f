"""Pallas splash attention (`jax.experimental.pallas.ops.tpu.splash_attention`): MaxText's `attention=flash` on a TPU.

The same result as `ops.attention.dot_product_attention` for a sequence attending over itself (training, a
prefill without a cache), without its [T, S] scores: the kernel walks blocks of queries and keys, skips the
blocks its mask leaves empty, and has its own backward pass. Splash masks by index where maxbridge masks by
position; the two agree wherever each document's positions count up by one from its first token, as packed
training data has them. So causality and sliding windows are splash's own block-sparse masks, while chunks
(Llama 4), which count from each document's start, join the segment ids: every (document, chunk) is a segment.

The kernel runs on one device. Under an active mesh it is `shard_map`ped over the batch and head axes, as
MaxText does; the sequence stays whole on each device (context parallelism is refused).
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as splash_mask
from jax.sharding import PartitionSpec

from maxbridge.core import config_rules, sharding
from maxbridge.ops.attention_mask import MASK_VALUE

# Splash's blocks are multiples of the TPU's 128 lanes.
LANES = splash.NUM_LANES


@dataclasses.dataclass(frozen=True)
class Blocks:
  """Splash's block sizes (queries or keys per block, in the forward pass and the two backward kernels) and the
  memory layouts of its inputs: MaxText's `sa_*` keys (`KEYS`), with base.yml's defaults. A size past the
  sequence is clipped to it (rounded up to whole lanes), and the sequence is padded to a multiple of every size.
  With the fused backward kernel (`fused_bwd`), dq is computed with dk and dv and its sizes are unused."""

  q: int = 512
  kv: int = 512
  kv_compute: int = 512
  q_dkv: int = 512
  kv_dkv: int = 512
  kv_dkv_compute: int = 512
  q_dq: int = 512
  kv_dq: int = 512
  fused_bwd: bool = False
  q_layout: str = "HEAD_DIM_MINOR"
  k_layout: str = "HEAD_DIM_MINOR"
  v_layout: str = "HEAD_DIM_MINOR"

  @classmethod
  def of_config(cls, config) -> "Blocks":
    return cls(**{field: getattr(config, key) for field, key in KEYS.items()})

  def sizes(self) -> dict[str, int]:
    """The sizes the kernels use: with `fused_bwd`, not dq's."""
    unused = ("q_dq", "kv_dq") if self.fused_bwd else ()
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.type is int and f.name not in unused}

  def clipped(self, length: int) -> "Blocks":
    """Each size at most `length` rounded up to whole lanes."""
    whole = -(-length // LANES) * LANES
    return dataclasses.replace(self, **{name: min(size, whole) for name, size in self.sizes().items()})


# Blocks' field -> its config key (MaxText's). The sizes are named once, in `config_rules.SPLASH_BLOCKS` (which
# checks their values and cannot import this layer); Blocks must have a field for each and no other size.
KEYS = {
    **{name: f"sa_block_{name}" for name in config_rules.SPLASH_BLOCKS},
    "fused_bwd": "sa_use_fused_bwd_kernel",
    **{f"{x}_layout": f"sa_{x}_layout" for x in "qkv"},
}
if {f.name for f in dataclasses.fields(Blocks) if f.type is int} != set(config_rules.SPLASH_BLOCKS):
  raise ImportError("ops.splash_attention.Blocks' sizes differ from config_rules.SPLASH_BLOCKS: name each in both")
DEFAULT = Blocks()
# None: run the Pallas interpreter unless the step is compiled for a TPU (`sharding.platform`). Tests set True to
# run the TPU path on the CPU.
INTERPRET: bool | None = None
# The segment id of the padding added to reach a whole block; real segment ids are >= 0.
_PAD_SEGMENT = -1


def unsupported(
    query: jax.Array, key: jax.Array, value: jax.Array, *, return_max_logits: bool = False, **_
) -> str | None:
  """What splash cannot do for these arguments (`ops.attention`'s kernel keywords), or None."""
  if sharding.axis_size("context") > 1:
    return (
        f"gather keys and values over the context axis (context parallelism of {sharding.axis_size('context')}): "
        "set ici_context_parallelism=1"
    )
  if return_max_logits:
    return "return QK-Clip's per-head max logits (use_qk_clip=true)"
  return None


def splash_attention(
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
    blocks: Blocks | None = None,
) -> jax.Array:
  """`ops.attention.dot_product_attention`'s arguments and result for self-attention: query [B, T, N, H], key
  [B, T, K, H], value [B, T, K, Hv] -> [B, T, N, Hv]; `blocks` defaults to `DEFAULT` (read at each call)."""
  reason = unsupported(query, key, value, return_max_logits=return_max_logits)
  if reason:
    raise ValueError(f"attention=flash on a TPU (Pallas splash attention) cannot {reason}; or set attention=dot_product")
  if isinstance(key, tuple) or key.shape[1] != query.shape[1]:
    raise ValueError(
        f"splash attention attends a sequence over itself; got {query.shape[1]} queries and keys "
        f"{[k.shape for k in key] if isinstance(key, tuple) else key.shape} (a decode step reads dot_product)"
    )
  batch, length, num_heads, _ = query.shape
  num_kv_heads = key.shape[2]
  if num_heads % num_kv_heads:
    raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} kv heads")
  with jax.named_scope("splash_attention"):
    if query_scale is not None:
      query = query * jnp.asarray(query_scale, query.dtype)
    if chunk_size:
      q_segment_ids = _chunk_segments(q_segment_ids, q_positions, chunk_size)
      kv_segment_ids = _chunk_segments(kv_segment_ids, kv_positions, chunk_size)
    blocks = (blocks or DEFAULT).clipped(length)
    padded = -(-length // math.lcm(*blocks.sizes().values())) * math.lcm(*blocks.sizes().values())
    # [B, heads, T, H], as splash reads them, padded to whole blocks.
    query, key, value = (_pad(x, 1, padded, 0).transpose(0, 2, 1, 3) for x in (query, key, value))
    q_segment_ids, kv_segment_ids = (_pad(x, 1, padded, _PAD_SEGMENT) for x in (q_segment_ids, kv_segment_ids))
    kernel = functools.partial(
        _attend,
        blocks=blocks,
        sliding_window_size=sliding_window_size,
        logits_soft_cap=logits_soft_cap,
        interpret=INTERPRET if INTERPRET is not None else sharding.platform() != "tpu",
    )
    args = (query, key, value, q_segment_ids, kv_segment_ids, sinks)
    out = _sharded(kernel, args) if sharding.current() is not None else kernel(*args)
    out = out.transpose(0, 2, 1, 3)[:, :length]
    return sharding.constrain(out, ("activation_batch", "activation_length", "activation_heads", "activation_kv"))


def _attend(query, key, value, q_segment_ids, kv_segment_ids, sinks, **options):
  """One device's share: query [b, n, T, H], key and value [b, k, T, H] -> [b, n, T, Hv]."""
  kernel = _kernel(query.shape[1], query.shape[2], **options)
  segment_ids = splash.SegmentIds(q_segment_ids, kv_segment_ids)
  if sinks is None:
    return jax.vmap(kernel)(query, key, value, segment_ids)
  return jax.vmap(lambda q, k, v, s: kernel(q, k, v, s, sinks.astype(jnp.float32)))(query, key, value, segment_ids)


def _kernel(num_heads, length, *, blocks, sliding_window_size, logits_soft_cap, interpret):
  shape = (length, length)
  if sliding_window_size:  # query i sees keys i - W + 1 ... i
    mask = splash_mask.LocalMask(shape, window_size=(sliding_window_size - 1, 0), offset=0)
  else:
    mask = splash_mask.CausalMask(shape)
  sizes = {f"block_{name}": size for name, size in blocks.sizes().items()}
  if blocks.fused_bwd:  # dq comes from the dk/dv kernel
    sizes |= dict(block_q_dq=None, block_kv_dq=None)
  layouts = {name: splash.QKVLayout[getattr(blocks, name)] for name in ("q_layout", "k_layout", "v_layout")}
  # Built in each trace (its mask tables are that trace's constants); the costly part, processing the mask block by
  # block in numpy, splash caches by the mask's value.
  return splash.make_splash_mha(
      splash_mask.MultiHeadMask([mask] * num_heads),
      block_sizes=splash.BlockSizes(**sizes, use_fused_bwd_kernel=blocks.fused_bwd, **layouts),
      head_shards=1,
      q_seq_shards=1,
      mask_value=MASK_VALUE,
      attn_logits_soft_cap=logits_soft_cap or None,
      interpret=interpret,
  )


def _sharded(kernel, args):
  """`kernel` shard_mapped over the active mesh: batch over activation_batch's axes, heads over
  activation_heads', each only where its size divides; sequence and head width whole on each device."""
  mesh, rules = sharding.current()
  query, key, value, q_segment_ids, kv_segment_ids, sinks = args
  batch_axes = _axes_dividing(mesh, rules, "activation_batch", query.shape[0])
  head_axes = _axes_dividing(mesh, rules, "activation_heads", query.shape[1])
  if head_axes and key.shape[1] % _size(mesh, head_axes):
    # Fewer kv heads than head shards: each shard needs its query heads' kv heads, so they are repeated to one
    # per query head (MaxText shards kv heads alike).
    key, value = (jnp.repeat(x, query.shape[1] // key.shape[1], axis=1) for x in (key, value))
  heads = PartitionSpec(batch_axes, head_axes, None, None)
  segments = PartitionSpec(batch_axes, None)
  sink_spec = None if sinks is None else PartitionSpec(head_axes)
  return jax.shard_map(
      kernel,
      mesh=mesh,
      in_specs=(heads, heads, heads, segments, segments, sink_spec),
      out_specs=heads,
      check_vma=False,  # a pallas_call does not track which axes its outputs vary over
  )(query, key, value, q_segment_ids, kv_segment_ids, sinks)


def _axes_dividing(mesh, rules, logical: str, size: int):
  axes = sharding.logical_to_spec((logical,), rules)[0]
  if axes is None:
    return None
  axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes) if mesh.shape[a] > 1)
  return axes if axes and size % _size(mesh, axes) == 0 else None


def _size(mesh, axes) -> int:
  return int(np.prod([mesh.shape[a] for a in axes]))


def _chunk_segments(segment_ids: jax.Array, positions: jax.Array, chunk_size: int) -> jax.Array:
  """[B, T] ids, one per run of tokens of one document and one chunk of its positions (the first is 0)."""
  chunks = positions // chunk_size
  starts = (segment_ids[:, 1:] != segment_ids[:, :-1]) | (chunks[:, 1:] != chunks[:, :-1])
  return jnp.concatenate([jnp.zeros_like(segment_ids[:, :1]), jnp.cumsum(starts, axis=1, dtype=segment_ids.dtype)], 1)


def _pad(x: jax.Array, axis: int, size: int, value) -> jax.Array:
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, size - x.shape[axis])
  return jnp.pad(x, widths, constant_values=value)
