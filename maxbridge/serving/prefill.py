"""An engine's ways to prefill, and the `Prefix` each gives `insert`.

`Prefiller.one` runs `Engine.prefill` (one prompt, or with `existing_prefix`
a chunk that goes on where that prefix stopped: chunked prefill) and
`prefill_multisampling` (several first tokens from one prefill); `concat` runs
`prefill_concat` (several prompts packed into one prefill, split back into one
prefix each) and `batch` runs `prefill_batch` (several prompts side by side,
one batch row each). Each checks and pads its prompts on the host, then runs
one compiled function, jitted once per shape.

A prefix's cache is one prompt's (batch 1); with `stack_prefill_result_cache`
its layers are stacked on a leading layer axis (`stacked`: the scanned tree),
which `insert` unstacks again (`unstacked`).
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.core import canonical
from maxbridge.core.config import Config
from maxbridge.models import decoding
from maxbridge.models.model import Model, check_multimodal
from maxbridge.ops import kv_cache, vision
from maxbridge.serving.positions import HostPositions, window_note

Params = dict[str, Any]


class Prefix(NamedTuple):
  """What `prefill` gives `insert`: one prompt's cache (batch 1), its first sampled token and where decoding goes on."""

  cache: Params
  token: jax.Array  # int32 [], or [num_samples] from prefill_multisampling
  next_pos: jax.Array  # int32 []: the prompt's length, the position of `token`
  logits: jax.Array  # float32 [V]: the logits `token` was sampled from


class Prefiller:
  """One engine's prefills (see the module docstring), over what the engine lends them.

  `positions`: the engine's host copy of positions, which learns each
  prefix's `next_pos`. `params`: the engine's parameters (or a caller's,
  unrolled to its layout) and its adapters, as the compiled functions take
  them; `weights` merges the two inside them. `next_rng`: a caller's key, or
  the next of the engine's own. `sample`: the engine's sampling by the
  decode_sampling_* keys.
  """

  def __init__(
      self,
      config: Config,
      model: Model,
      positions: HostPositions,
      *,
      params: Callable,
      weights: Callable,
      next_rng: Callable,
      sample: Callable,
  ):
    self.config, self.model, self._positions = config, model, positions
    self._params, self._weights, self._next_rng, self._sample = params, weights, next_rng, sample
    # What a prefix of this engine holds, to refuse one of another engine by name rather than by JAX's shapes.
    self._prefix_shapes = {
        path: leaf.shape
        for path, leaf in canonical.flatten(
            jax.eval_shape(lambda: self.stacked(decoding.init_cache(self.config, 1, self.config.max_target_length)))
        ).items()
    }
    self.compiled_one = jax.jit(self._one, static_argnames=("num_samples",))
    self.compiled_concat = jax.jit(self._concat)
    self.compiled_batch = jax.jit(self._batch)

  # --- one prompt -------------------------------------------------------------------------------

  def one(self, tokens, true_length, existing_prefix, params, rng, *, num_samples: int, images=None) -> Prefix:
    """`Engine.prefill`, or with `num_samples` > 0 `prefill_multisampling`; `images` [N, H, W, C] fill the prompt's
    image tokens (a model with a vision tower)."""
    tokens = self.check_prompt(tokens)
    true_length = len(tokens) if true_length is None else int(true_length)
    if not 0 < true_length <= len(tokens):
      raise ValueError(f"true_length={true_length} must be in [1, {len(tokens)}] (the prompt's length)")
    padded = self.pad(tokens)
    cache, start = None, np.int32(0)
    if existing_prefix is not None:
      self.check_prefix(existing_prefix)
      cache, start = self.unstacked(existing_prefix.cache), existing_prefix.next_pos
      if int(self._positions.get(start)) + len(padded) > self.config.max_target_length:
        raise ValueError(
            f"a chunk of {len(padded)} tokens (padded) after {int(self._positions.get(start))} exceeds "
            f"max_target_length={self.config.max_target_length}, the tokens a cache holds"
        )
    next_pos = self._positions.get(start) + true_length
    multimodal_input = None
    if images is not None:
      if existing_prefix is not None:
        raise ValueError("images go with a whole prompt: a chunk continuing a prefix (existing_prefix) takes none")
      multimodal_input = vision.MultimodalInput(jnp.asarray(images)[None])
      check_multimodal(self.config, jnp.asarray(padded)[None], multimodal_input)
    params = self._params(params)
    rng = self._next_rng(rng)
    prefix = self.compiled_one(
        params, padded, np.int32(true_length), rng, cache, start, multimodal_input, num_samples=num_samples
    )
    self._positions.put(prefix.next_pos, next_pos)
    return prefix

  def pad(self, tokens: np.ndarray) -> np.ndarray:
    length = min(max(16, 1 << (len(tokens) - 1).bit_length()), self.config.max_prefill_predict_length)
    padded = np.zeros((length,), np.int32)
    padded[: len(tokens)] = tokens
    return padded

  def check_prompt(self, tokens) -> np.ndarray:
    tokens = np.asarray(tokens)
    limit = self.config.max_prefill_predict_length
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
      raise ValueError(f"a prompt must be int tokens [length], got {tokens.dtype} {tokens.shape}")
    if tokens.size == 0:
      raise ValueError("a prompt must hold at least one token, got an empty one")
    if tokens.size > limit:
      raise ValueError(f"the prompt has {tokens.size} tokens, more than max_prefill_predict_length={limit}")
    vocab = self.config.vocab_size
    bad = np.flatnonzero((tokens < 0) | (tokens >= vocab))
    if bad.size:
      raise ValueError(
          f"prompt token {int(tokens[bad[0]])} at index {int(bad[0])} is outside the vocabulary [0, {vocab})"
      )
    return tokens.astype(np.int32)

  def _one(self, params, tokens, true_length, rng, cache, start, multimodal_input=None, *, num_samples: int):
    params = self._weights(params)
    if cache is None:
      cache = decoding.init_cache(self.config, 1, self.config.max_target_length)
    offsets = jnp.arange(tokens.shape[0], dtype=jnp.int32)[None]
    # Padding gets segment 0: no real token ever sees it, and decoding writes over it.
    segment_ids = (offsets < true_length).astype(jnp.int32)
    logits, cache = self.model.cached_forward(params, cache, tokens[None], start + offsets, segment_ids, multimodal_input)
    next_pos = start + true_length
    cache = _set_cache_index(cache, next_pos)
    last = logits[0, true_length - 1]
    token = self._sample(jnp.broadcast_to(last, (num_samples, last.shape[0])) if num_samples else last, rng)
    return Prefix(self.stacked(cache), token, next_pos, last)

  # --- several prompts --------------------------------------------------------------------------

  def concat(self, prompts, params, rng) -> list[Prefix]:
    """`Engine.prefill_concat`: the prompts packed into one row, segment ids and positions per prompt."""
    recurrent = [stack.name for stack in self.config.family.stacks if stack.recurrent]
    if recurrent:
      raise ValueError(
          f"prefill_concat with decoder_block={self.config.decoder_block!r}: its recurrent layers (stack "
          f"{recurrent[0]!r}) keep one fixed-size state per row, the state after the row's last token, which a "
          "packed prefill cannot split into each prompt's own; use prefill, or prefill_batch (a row per prompt)"
      )
    prompts = [self.check_prompt(prompt) for prompt in prompts]
    lengths = [len(prompt) for prompt in prompts]
    if not prompts or sum(lengths) > self.config.max_prefill_predict_length:
      raise ValueError(
          f"prefill_concat packs 1 or more prompts into max_prefill_predict_length="
          f"{self.config.max_prefill_predict_length} tokens; got {len(prompts)} prompts of {sum(lengths)} tokens"
      )
    tokens = self.pad(np.concatenate(prompts))
    positions, segment_ids = np.zeros_like(tokens), np.zeros_like(tokens)
    offsets = np.cumsum([0, *lengths[:-1]]).astype(np.int32)
    for i, (offset, length) in enumerate(zip(offsets, lengths)):
      positions[offset : offset + length] = np.arange(length)
      segment_ids[offset : offset + length] = i + 1
    params = self._params(params)
    rng = self._next_rng(rng)
    lengths = np.asarray(lengths, np.int32)
    prefixes = self.compiled_concat(params, tokens, positions, segment_ids, offsets, lengths, rng)
    return self._remember_lengths(prefixes, lengths)

  def _concat(self, params, tokens, positions, segment_ids, offsets, lengths, rng):
    params = self._weights(params)
    # Not a ring even for a windowed model: a later prompt would overwrite an earlier one's last entries.
    cache = decoding.init_cache(self.config, 1, max(tokens.shape[0], self.config.max_target_length), ring=False)
    logits, cache = self.model.cached_forward(params, cache, tokens[None], positions[None], segment_ids[None])
    prefixes = []
    for i, rng in enumerate(jax.random.split(rng, len(offsets))):
      last = logits[0, offsets[i] + lengths[i] - 1]
      one = _split_packed(cache, offsets[i], lengths[i])
      if decoding.has_ring(self.config):
        one = _to_ring(self.config, one, lengths[i])
      prefixes.append(Prefix(self.stacked(one), self._sample(last, rng), lengths[i], last))
    return prefixes

  def batch(self, prompts, params, rng) -> list[Prefix]:
    """`Engine.prefill_batch`: the prompts side by side, one row each, padded to the longest."""
    prompts = [self.check_prompt(prompt) for prompt in prompts]
    if not prompts:
      raise ValueError("prefill_batch needs at least one prompt, got none")
    lengths = np.asarray([len(prompt) for prompt in prompts], np.int32)
    tokens = np.zeros((len(prompts), len(self.pad(prompts[int(np.argmax(lengths))]))), np.int32)
    for row, prompt in zip(tokens, prompts):
      row[: len(prompt)] = prompt
    params = self._params(params)
    rng = self._next_rng(rng)
    return self._remember_lengths(self.compiled_batch(params, tokens, lengths, rng), lengths)

  def _remember_lengths(self, prefixes: list[Prefix], lengths) -> list[Prefix]:
    for prefix, length in zip(prefixes, lengths):
      self._positions.put(prefix.next_pos, length)
    return prefixes

  def _batch(self, params, tokens, lengths, rng):
    params = self._weights(params)
    batch, length = tokens.shape
    cache = decoding.init_cache(self.config, batch, self.config.max_target_length)
    offsets = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), tokens.shape)
    segment_ids = (offsets < lengths[:, None]).astype(jnp.int32)  # padding: segment 0, as in `prefill`
    logits, cache = self.model.cached_forward(params, cache, tokens, offsets, segment_ids)
    cache = _set_cache_index(cache, lengths)
    prefixes = []
    for i, rng in enumerate(jax.random.split(rng, batch)):
      last = logits[i, lengths[i] - 1]
      one = jax.tree.map(lambda leaf, i=i: leaf[i : i + 1], cache)
      prefixes.append(Prefix(self.stacked(one), self._sample(last, rng), lengths[i], last))
    return prefixes

  # --- the prefix cache's layout ------------------------------------------------------------------

  def stacked(self, cache: Params) -> Params:
    """With stack_prefill_result_cache, the layers' caches stacked on a leading layer axis (the scanned tree)."""
    if self.config.stack_prefill_result_cache:
      return canonical.stack_layers(cache, axis=0)
    return cache

  def unstacked(self, cache: Params) -> Params:
    if self.config.stack_prefill_result_cache:
      return canonical.unstack_layers(cache, axis=0)
    return cache

  def check_prefix(self, prefix: Prefix) -> None:
    """A prefix another engine made fits this one's slots only with the same cache tree and length."""
    got = {path: np.shape(leaf) for path, leaf in canonical.flatten(prefix.cache).items()}
    want = self._prefix_shapes
    if sorted(got) != sorted(want):
      extra, missing = sorted(set(got) - set(want)), sorted(set(want) - set(got))
      raise ValueError(
          f"this prefix's cache is not one this engine makes (missing {missing[:2]}, unexpected {extra[:2]}): "
          "prefill it with this engine (same model, stack_prefill_result_cache and scan_layers)"
      )
    for path, shape in want.items():
      if got[path] == shape:
        continue
      if path.endswith("/" + kv_cache.POSITIONS):  # [..., 1, entries]: a stacked cache leads with its layers
        raise ValueError(
            f"this prefix's cache holds {got[path][-1]} tokens per row and this engine's slots hold {shape[-1]} "
            f"(max_target_length={self.config.max_target_length}{window_note(self.config)}): it was prefilled "
            "by an engine with another max_target_length; prefill it with this engine"
        )
      raise ValueError(f"this prefix's cache {path} is {got[path]}, this engine's is {shape}: prefill it here")


def _split_packed(cache: Params, offset, length) -> Params:
  """One prompt's cache out of a packed prefill: its entries moved to the front, the rest cleared.

  Its segment becomes 1, the one decoding reads; positions are its own already.
  """
  flat = canonical.flatten(cache)
  for path, leaf in flat.items():
    if path.endswith("/" + kv_cache.INDEX):
      flat[path] = jnp.full_like(leaf, length)
      continue
    axis = kv_cache.sequence_axis(path.rsplit("/", 1)[1])
    shape = [1] * leaf.ndim
    shape[axis] = leaf.shape[axis]
    visible = jnp.arange(leaf.shape[axis]).reshape(shape) < length
    if path.endswith("/" + kv_cache.SEGMENT_IDS):
      flat[path] = jnp.broadcast_to(visible, leaf.shape).astype(leaf.dtype)
    else:
      flat[path] = jnp.where(visible, jnp.roll(leaf, -offset, axis=axis), jnp.zeros((), leaf.dtype))
  return canonical.unflatten(flat)


def _to_ring(config: Config, cache: Params, length) -> Params:
  """One prompt's cache, its `length` entries at the front of a longer buffer -> the ring its own prefill leaves."""
  flat, ring = canonical.flatten(cache), canonical.flatten(decoding.init_cache(config, 1, config.max_target_length))
  for layer in {path.rsplit("/", 1)[0] for path in flat}:
    entries = {path.rsplit("/", 1)[1]: leaf for path, leaf in flat.items() if path.startswith(layer + "/")}
    empty = {name: ring[f"{layer}/{name}"] for name in entries}
    written = kv_cache.ring_append(
        empty,
        {
            name: kv_cache.load(entries, name)
            for name in entries
            if name not in kv_cache.BOOKKEEPING and not kv_cache.is_scale(name)
        },
        entries[kv_cache.POSITIONS],
        entries[kv_cache.SEGMENT_IDS],
    )
    flat.update({f"{layer}/{name}": leaf for name, leaf in written.items()})
  return _set_cache_index(canonical.unflatten(flat), length)


def _set_cache_index(cache: Params, value) -> Params:
  """Every layer's next write index set to `value` (after a padded prefill: the true length)."""
  flat = canonical.flatten(cache)
  for path, leaf in flat.items():
    if path.endswith("/" + kv_cache.INDEX):
      flat[path] = jnp.full_like(leaf, value)
  return canonical.unflatten(flat)
