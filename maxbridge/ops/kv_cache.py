"""The decode cache of one attention layer, as pure functions over a dict of arrays.

Per batch row, a cache holds what the tokens seen so far give attention (keys
and values; for MLA the compressed latent and the rotated RoPE key) together
with their positions and segment ids, so the mask of a cached read is built
from positions exactly as an uncached one is (`ops.attention.attention_mask`).
Entries never written have segment 0, which no query has: they are invisible.
`cache_index` [B] is where a row's next tokens are written, so a row may hold
several packed prompts, or prompt padding that decoding writes over.

A layer with a sliding window W (Mistral's `sliding_window_size`) keeps a ring
of W entries per row, as MaxText's and Hugging Face's rolling caches do: token
i of a row lands at `i mod W`, so memory stays bounded however long it decodes.
The mask needs no change (an entry carries its own position), but a chunk of
several tokens reads the cache as it was *before* the write, plus itself: the
ring overwrites entries that the chunk's first tokens still see.

With `quantize_kvcache` (MaxText's key; `kv_quant_dtype: int8`), each float
entry is stored int8 with one scale per token and head (its absolute maximum
over the feature axis / 127, MaxText's kv_quant_axis "dkv"), kept beside it as
`<entry>_scale` in the activation dtype and multiplied back on every read.
"""

from typing import Mapping

import jax
import jax.numpy as jnp

POSITIONS = "cache_positions"
SEGMENT_IDS = "cache_segment_ids"
INDEX = "cache_index"
# A recurrent layer's decode state (Qwen3-Next's gated DeltaNet): its [heads, k, v] matrix and convolution window.
RECURRENT_STATE, CONV_WINDOW = "recurrent_state", "conv_window"
BOOKKEEPING = (POSITIONS, SEGMENT_IDS, INDEX)
SCALE = "_scale"
_FEATURE_AXES = ("cache_kv", "cache_kv_lora")

# Each entry's logical axes, in the order it is stored. Keys and values are
# stored head-major, keys transposed ([B, K, H, S] and [B, K, S, H]): as the
# two attention products read them (`ops.attention`: batch and head axes
# first, each product's contracted axis ahead of its output axis). Stored in
# token order ([B, S, K, H]), every layer's keys and values were copied on
# every decode step; stored [B, K, S, H], keys were read by the query-key
# product at a third of the value product's speed. XLA CPU, llama-small, 8
# slots, 256 cached tokens, side by side: a step took 1.14x as long token-major
# as with [B, K, S, H] for both, and that 1.17x as long as this layout.
_ENTRY_AXES = {
    "cached_key": ("cache_batch", "cache_kv_heads", "cache_kv", "cache_sequence"),
    "cached_value": ("cache_batch", "cache_kv_heads", "cache_sequence", "cache_kv"),
    "cached_latent": ("cache_batch", "cache_sequence", "cache_kv_lora"),
    "cached_key_rope": ("cache_batch", "cache_sequence", "cache_kv"),
    "cached_index_key": ("cache_batch", "cache_sequence", "cache_kv"),  # DeepSeek-V3.2's indexer keys
    POSITIONS: ("cache_batch", "cache_sequence"),
    SEGMENT_IDS: ("cache_batch", "cache_sequence"),
    INDEX: ("cache_batch",),
    # A recurrent layer's state (`Family.recurrent_state`): a fixed size per row, whatever the tokens seen.
    RECURRENT_STATE: ("cache_batch", "cache_kv_heads", None, None),
    CONV_WINDOW: ("cache_batch", None, None),
}
# Recurrent entries kept in float32 whatever the activation dtype: a recurrence accumulates its rounding.
_FLOAT32_STATE = (RECURRENT_STATE,)


def entries(config) -> dict[str, tuple[int, ...]]:
  """Name -> per-token shape (in token order) of what one attention layer of `config` caches.

  The family names them (`cache_entries`): keys and values, or for MLA
  (DeepSeek) the normed latent and the rotated shared rope key, as DeepSeek
  does, expanded to keys and values on every read.
  """
  return config.family.cache_entries(config)


def window(config) -> int:
  """The ring length of `config`'s layers (its sliding window), or 0 for a cache of every token.

  0 also where only some layers are windowed (`Family.ring_cache`): they mask by position instead.
  """
  return config.sliding_window_size if config.family.ring_cache else 0


def abstract(
    config,
    batch: int,
    length: int,
    *,
    ring: bool = True,
    ring_length: int | None = None,
    own_entries: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, jax.ShapeDtypeStruct]:
  """One layer's empty cache for rows of `length` tokens, as shapes: `length` entries, or (`ring`) a window's.

  `ring_length` replaces the window for a layer that keeps its own ring (`Stack.rings`); `own_entries` the
  family's entries for a layer that caches its own (`Stack.caches`).
  """
  dtype = jnp.dtype(config.dtype)
  size = window(config) if ring_length is None else ring_length
  if ring and size:
    length = min(length, size)
  quantized = quantized_dtype(config)
  out = {}
  for name, shape in (entries(config) if own_entries is None else own_entries).items():
    stored = [batch, *shape]
    stored.insert(sequence_axis(name), length)
    out[name] = jax.ShapeDtypeStruct(tuple(stored), quantized or dtype)
    if quantized:
      stored[feature_axis(name)] = 1
      out[name + SCALE] = jax.ShapeDtypeStruct(tuple(stored), dtype)
  out[POSITIONS] = out[SEGMENT_IDS] = jax.ShapeDtypeStruct((batch, length), jnp.int32)
  out[INDEX] = jax.ShapeDtypeStruct((batch,), jnp.int32)
  return out


def recurrent_abstract(config, batch: int) -> dict[str, jax.ShapeDtypeStruct]:
  """One recurrent layer's empty decode state (`Family.recurrent_state`), as shapes: never quantized."""
  return {
      name: jax.ShapeDtypeStruct((batch, *shape), jnp.float32 if name in _FLOAT32_STATE else jnp.dtype(config.dtype))
      for name, shape in config.family.recurrent_state(config).items()
  }


def quantized_dtype(config):
  """The integer dtype `config` stores keys and values in (`quantize_kvcache`), or None for its float dtype."""
  if not config.quantize_kvcache:
    return None
  if config.kv_quant_dtype != "int8":
    raise ValueError(f"kv_quant_dtype={config.kv_quant_dtype!r}: the quantized KV cache stores int8 only")
  return jnp.dtype(jnp.int8)


def is_scale(name: str) -> bool:
  return name.endswith(SCALE)


def logical_axes(name: str) -> tuple[str, ...]:
  if is_scale(name):  # its entry's axes, the feature axis reduced to one
    return tuple(None if axis in _FEATURE_AXES else axis for axis in _ENTRY_AXES[name.removesuffix(SCALE)])
  return _ENTRY_AXES[name]


def sequence_axis(name: str) -> int:
  """The axis of entry `name` that runs over the cached tokens."""
  return logical_axes(name).index("cache_sequence")


def feature_axis(name: str) -> int:
  """The axis of entry `name` (stored) that a quantized cache keeps one scale across."""
  return next(i for i, axis in enumerate(_ENTRY_AXES[name]) if axis in _FEATURE_AXES)


def stored_names(new, present) -> tuple[str, ...]:
  """The entries an attention layer's `update` reads and writes: `new`'s, their scales where `present(name)`
  says the cache holds them (a quantized cache), and the bookkeeping."""
  scales = [name + SCALE for name in new if present(name + SCALE)]
  return (*new, *scales, POSITIONS, SEGMENT_IDS, INDEX)


def quantize(stored: jax.Array, axis: int, dtype) -> tuple[jax.Array, jax.Array]:
  """(int8 values, scales in `dtype`): symmetric, one scale per slice along `axis`, max |x| -> 127."""
  stored = stored.astype(jnp.float32)
  scale = jnp.max(jnp.abs(stored), axis=axis, keepdims=True) / 127.0
  values = jnp.round(stored / jnp.where(scale > 0, scale, 1.0))
  return jnp.clip(values, -127, 127).astype(jnp.int8), scale.astype(dtype)


def load(cache: Mapping[str, jax.Array], name: str) -> jax.Array:
  """Entry `name` of `cache` in token order ([B, S, ...]), dequantized where the cache holds its scale."""
  stored = cache[name]
  if name + SCALE in cache:
    scale = cache[name + SCALE]
    stored = stored.astype(scale.dtype) * scale
  return from_stored(name, stored)


def _encode(cache: Mapping[str, jax.Array], new: Mapping[str, jax.Array], positions, segment_ids) -> dict:
  """What a write puts into `cache`, each in its stored order and dtype: `new`'s entries (quantized, with
  their scales, where the cache holds scales) and the tokens' positions and segment ids."""
  out = {}
  for name, values in new.items():
    if name + SCALE in cache:
      out[name], out[name + SCALE] = quantize(to_stored(name, values), feature_axis(name), cache[name + SCALE].dtype)
    else:
      out[name] = to_stored(name, values.astype(cache[name].dtype))
  return {**out, POSITIONS: positions, SEGMENT_IDS: segment_ids}


def to_stored(name: str, values: jax.Array) -> jax.Array:
  """Values of entry `name` in token order ([B, T, ...], as attention makes them) -> the order it is stored in."""
  return jnp.moveaxis(values, 1, sequence_axis(name))


def from_stored(name: str, stored: jax.Array) -> jax.Array:
  """Entry `name` as stored -> token order ([B, S, ...]); the transpose cancels with the attention products' own."""
  return jnp.moveaxis(stored, sequence_axis(name), 1)


def append(
    cache: Mapping[str, jax.Array], new: Mapping[str, jax.Array], positions: jax.Array, segment_ids: jax.Array
) -> dict[str, jax.Array]:
  """Writes `new` ({name: [B, T, ...]}) and the tokens' positions and segment ids [B, T] at each row's index.

  Returns the whole updated cache; the caller attends over all of it. A row
  written past its end keeps its last entries (dynamic_update_slice clamps);
  the engine bounds lengths so that never happens.
  """
  index = cache[INDEX]

  def write(name: str, values: jax.Array) -> jax.Array:
    # One dynamic_update_slice per row, not a vmap of one: vmapped, the
    # per-row indices make it a scatter, which rewrote the whole cache on
    # every decode step (4x the step time at 8 slots on CPU).
    buffer, axis = cache[name], sequence_axis(name)
    for b in range(buffer.shape[0]):
      start = [0] * buffer.ndim
      start[0], start[axis] = b, index[b]
      buffer = jax.lax.dynamic_update_slice(buffer, values[b : b + 1], start)
    return buffer

  out = dict(cache)
  for name, values in _encode(cache, new, positions, segment_ids).items():
    out[name] = write(name, values)
  out[INDEX] = index + positions.shape[1]
  return out


def update(
    cache: Mapping[str, jax.Array],
    new: Mapping[str, jax.Array],
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    ring: bool = False,
) -> tuple[dict[str, jax.Array], tuple[jax.Array, ...], dict[str, jax.Array]]:
  """(the updated cache; what attention reads for each of `new`'s entries, in order; the keywords masking it).

  Without `ring`, `append` then `read`. With `ring` (a windowed layer's cache),
  one token per row is written at index mod length and the ring is read; a
  chunk writes only its last real tokens (`ring_append`) and reads the cache as
  it was, followed by the chunk as the cache stores it (`read_first`). Layers
  read first and write after (`read_first`, `write`); Gemma 4's keep this order.
  """
  if not ring:
    out = append(cache, new, positions, segment_ids)
    return (out, *read(out, new))
  out = ring_append(cache, new, positions, segment_ids)
  if positions.shape[1] == 1:
    return (out, *read(out, new))
  blocks, keywords = read_first(cache, new, positions, segment_ids, ring=True)
  return out, tuple(jnp.concatenate(parts, axis=1) for parts in blocks), keywords


# The segment id of the entries a write is about to replace, in a read made before it: no query has it.
REPLACED = -1


def read_first(
    cache: Mapping[str, jax.Array],
    new: Mapping[str, jax.Array],
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    ring: bool = False,
) -> tuple[tuple[tuple[jax.Array, jax.Array], ...], dict[str, jax.Array]]:
  """What `update` lets attention read, without writing: (for each of `new`'s entries, the blocks (the cache's,
  `new`'s as the cache stores them), which attention reads as one sequence; the keywords masking them).

  `write(..., after=attention's output)` then stores `new`. Attention then
  reads the cache as it lies, before the write: with the write first, at
  batch 1 XLA copied every layer's whole keys and values on every decode step
  (llama-small: 64 copies of 256 KB, ~1.4 ms of a ~6 ms step; see
  benchmarks/decode.py --per-step). The entries the write replaces get segment
  `REPLACED`, so each query sees the same keys as after the write (a rewound
  index, as speculative decoding's, leaves real entries there); a ring's chunk
  keeps them, as `update` reads it.
  """
  length, steps = cache[SEGMENT_IDS].shape[1], positions.shape[1]
  kept = cache[SEGMENT_IDS]
  if not ring or steps == 1:
    index = cache[INDEX] % length if ring else jnp.minimum(cache[INDEX], length - steps)  # as the write clamps
    offset = jnp.arange(length, dtype=jnp.int32)[None] - index[:, None]
    kept = jnp.where((offset >= 0) & (offset < steps), REPLACED, kept)
  encoded = _encode(cache, new, positions, segment_ids)
  values = tuple((load(cache, name), load(encoded, name)) for name in new)
  keywords = dict(
      kv_segment_ids=jnp.concatenate([kept, segment_ids], axis=1),
      kv_positions=jnp.concatenate([cache[POSITIONS], positions], axis=1),
  )
  return values, keywords


def write(
    cache: Mapping[str, jax.Array],
    new: Mapping[str, jax.Array],
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    ring: bool = False,
    after: jax.Array,
) -> dict[str, jax.Array]:
  """The cache updated as `update` leaves it, the write made only once `after` ([B, ...], attention's output
  over `read_first`'s blocks) is computed.

  XLA orders a buffer's in-place write after its reads only where data flows
  from the reads to the write (its copy insertion; an optimization barrier is
  removed before it on CPU), else it copies the buffer. So the write index
  takes a zero from `after`: x > x is false for every float, NaN included,
  and XLA does not fold it for floats.
  """
  probe = after.reshape(after.shape[0], -1)[:, 0]
  cache = {**cache, INDEX: cache[INDEX] + (probe > probe).astype(cache[INDEX].dtype)}
  return ring_append(cache, new, positions, segment_ids) if ring else append(cache, new, positions, segment_ids)


def ring_append(
    cache: Mapping[str, jax.Array], new: Mapping[str, jax.Array], positions: jax.Array, segment_ids: jax.Array
) -> dict[str, jax.Array]:
  """`append` into a ring of L entries per row: the row's token i (counted by `cache_index`) lands at i mod L.

  A chunk's real tokens are its leading ones (padding, segment 0, trails them;
  the engine then sets the index to the true length), and only the last L real
  tokens survive: entry s gets the last real token i with i mod L == s, or
  keeps its old value when the chunk has none.
  """
  index = cache[INDEX]
  length, steps = cache[SEGMENT_IDS].shape[1], positions.shape[1]
  if steps == 1:
    return append({**cache, INDEX: index % length}, new, positions, segment_ids) | {INDEX: index + 1}
  real = jnp.sum(segment_ids != 0, axis=1, dtype=jnp.int32)[:, None]  # [B, 1]
  slots = jnp.arange(length, dtype=jnp.int32)[None]  # [1, L]
  source = real - 1 - jnp.mod(real - 1 - (slots - index[:, None]), length)  # [B, L], < 0: none
  written = source >= 0
  source = jnp.clip(source, 0, steps - 1)

  def write(name: str, values: jax.Array) -> jax.Array:
    buffer, axis = cache[name], sequence_axis(name)
    shape = [1] * buffer.ndim  # [B, L] laid along the batch and sequence axes
    shape[0], shape[axis] = source.shape
    taken = jnp.take_along_axis(values, source.reshape(shape), axis=axis)
    return jnp.where(written.reshape(shape), taken, buffer)

  out = dict(cache)
  for name, values in _encode(cache, new, positions, segment_ids).items():
    out[name] = write(name, values)
  out[INDEX] = index + steps
  return out


def read(cache: Mapping[str, jax.Array], names) -> tuple[tuple[jax.Array, ...], dict[str, jax.Array]]:
  """(the `names` entries of `cache`, in order; the keyword arguments that mask attention over them).

  The keywords are `ops.attention.self_attention`'s `kv_segment_ids` and
  `kv_positions`: a cached read is masked by the cache's own positions.
  """
  values = tuple(load(cache, name) for name in names)
  return values, dict(kv_segment_ids=cache[SEGMENT_IDS], kv_positions=cache[POSITIONS])
