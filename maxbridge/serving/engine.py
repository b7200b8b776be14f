"""`mb.Engine`: prefill, insert and generate over decode slots with a KV cache, on MaxText's MaxEngine shape.

    engine = mb.Engine(config, params)              # or mb.Engine.from_pretrained(path)
    prefix = engine.prefill(tokens, true_length)    # cache, first token, next_pos, logits
    state = engine.init_decode_state()              # per_device_batch_size slots per device
    state = engine.insert(prefix, state, slot)
    state, tokens = engine.generate(state)          # one token for every slot

Also MaxText's serving features: `prefill_multisampling` (several first tokens
from one prefill, for `bulk_insert`), `prefill_concat` (several prompts packed
into one prefill, split back into one prefix each), `prefill_batch` (several
prompts side by side in one batched prefill, one prefix each), chunked prefill
(`prefill(..., existing_prefix=prefix)` goes on where a prefix stopped), and
`stack_prefill_result_cache` (a prefix cache stacked on a layer axis for either
`scan_layers`: the scanned cache tree, unstacked again on insert). Each way
to prefill is written in `serving.prefill`; the engine lends it its
parameters, key and sampling, and keeps the slots.

The cache is one canonical tree on both backends (`abstract_cache`), given to
the model's attention layers as Linen's "cache" collection or as `nnx.Cache`
variables (`Model.cached_forward`); the model itself never holds one. Every
step is jitted once per shape and donates the decode state it replaces;
`generate_steps` runs many steps in one compiled loop.

The engine decodes with unrolled layers (`decode_config`: scan_layers=False,
as MaxText's decode checkpoints are), whatever the checkpoint's layout: a
scanned layer loop reslices every stacked weight on each step, which made one
decoded token ~10x slower on CPU. Its caches are therefore one entry per layer,
and a prefix with `stack_prefill_result_cache` holds the scanned (stacked) tree.

LoRA adapters (`adapters=`, or `from_pretrained(base, adapters=run)`) are held
beside the base parameters, never merged into them: each compiled step adds
lora_alpha / lora_rank * A @ B to the kernels it reads (`lora.merge`, the
training forward pass's own), so one base serves any adapter set of the same
shapes (`set_adapters`) without a recompile. The price, with adapters merged
outside the layers (see maxbridge/models/lora.py), is rank x kernel size more flops
per adapted kernel and step.
"""

import warnings
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from absl import logging
from jax.sharding import Mesh, PartitionSpec

from maxbridge.core import canonical, sharding
from maxbridge.core.config import Config
from maxbridge.interop import pretrained
from maxbridge.models import decoding, dispatch, lora
from maxbridge.models import model as model_lib
from maxbridge.models.model import Model
from maxbridge.ops import kv_cache
from maxbridge.ops import sampling as sampling_ops
from maxbridge.serving import speculative
from maxbridge.serving.positions import HostPositions, advanced, limit_text, position_limit
from maxbridge.serving.prefill import Prefiller, Prefix
from maxbridge.serving.slot_sampling import SlotSampling, sample_slots, score_tokens

Params = dict[str, Any]


class DecodeState(NamedTuple):
  """Every slot's cache, its last token (the next step's input) and that token's position.

  A slot at position 0 is idle: never filled, or `release`d. It stays at 0 however long the others decode,
  so it never runs out of cache, and what it samples means nothing.
  """

  cache: Params
  tokens: jax.Array  # int32 [slots]
  next_pos: jax.Array  # int32 [slots]
  logits: jax.Array  # float32 [slots, V]: the model's logits each slot's last token was sampled from
  # int32 [slots, V]: each token's count among a slot's generated ones (presence and frequency penalties read it)
  counts: jax.Array


def _is_axes(x) -> bool:
  return isinstance(x, tuple) and all(isinstance(name, (str, type(None))) for name in x)


class Engine:
  """Prefill, insert and generate over `per_device_batch_size` slots per device; see the module docstring."""

  tokenizer = None  # the model's `pretrained.TextTokenizer`, as `from_pretrained` finds it

  def __init__(
      self,
      config: Config,
      params: Params | None = None,
      *,
      model: Model | None = None,
      mesh: Mesh | None = None,
      adapters: Params | None = None,
  ):
    if not 0 < config.max_prefill_predict_length < config.max_target_length:
      raise ValueError(
          f"max_prefill_predict_length={config.max_prefill_predict_length} must be in [1, max_target_length="
          f"{config.max_target_length}): the cache holds max_target_length tokens, prompt and continuation"
      )
    if model is None:
      model = dispatch.create_model(decoding.decode_config(config), params=params)
    else:
      if params is not None:
        model.load_params(params)
      model = model_lib.decode_model(model)
    self.config = decoding.decode_config(config)
    _log_unquantized_states(self.config)
    self.model = model
    # Parameters and decode slots are sharded by their logical axes (the cache's
    # `cache_*` rules in logical_axis_rules): slots split over data and fsdp.
    self.mesh = sharding.create_mesh(self.config) if mesh is None else mesh
    rules = self.config.logical_axis_rules
    specs = jax.tree.map(lambda axes: PartitionSpec(*axes), model.logical_axes(), is_leaf=_is_axes)
    self.params = jax.device_put(model.params(), sharding.spec_tree_to_shardings(specs, self.mesh, rules))
    self._abstract_params = model.abstract_params()
    self.set_adapters(adapters)
    slots = sharding.named_sharding(self.mesh, ("cache_batch",), rules)
    self._state_shardings = DecodeState(
        jax.tree.map(
            lambda axes: sharding.named_sharding(self.mesh, axes, rules),
            decoding.cache_logical_axes(self.config),
            is_leaf=_is_axes,
        ),
        slots,
        slots,
        sharding.named_sharding(self.mesh, ("cache_batch", None), rules),
        sharding.named_sharding(self.mesh, ("cache_batch", None), rules),
    )
    sharding.check_divisible(self._abstract_decode_state(), self._state_shardings)
    self.position_limit = position_limit(self.config)
    self._positions = HostPositions()
    self._rng = jax.random.key(config.seed)
    self._prefiller = Prefiller(
        self.config,
        model,
        self._positions,
        params=self._params,
        weights=self._weights,
        next_rng=self._next_rng,
        sample=self._sample,
    )
    state, tokens = self._state_shardings, slots
    self._init_decode_state = jax.jit(
        lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), self._abstract_decode_state()), out_shardings=state
    )
    self._insert = jax.jit(self._insert_impl, donate_argnums=(1,), out_shardings=state)
    self._release = jax.jit(
        lambda state, slots: state._replace(next_pos=state.next_pos.at[slots].set(0)),
        donate_argnums=(0,),
        out_shardings=state,
    )
    self._generate = jax.jit(
        self._generate_impl, donate_argnums=(1,), static_argnames=("advance",), out_shardings=(state, tokens, None)
    )
    self._score_prompt = jax.jit(self._score_prompt_impl, static_argnames=("top",))
    self._generate_steps = jax.jit(
        self._generate_steps_impl,
        donate_argnums=(1,),
        static_argnames=("num_steps",),
        out_shardings=(state, sharding.named_sharding(self.mesh, ("cache_batch", None), rules)),
    )

  @classmethod
  def from_pretrained(cls, path, backend: str | None = None, *, adapters=None, **overrides) -> "Engine":
    """An engine on a maxbridge checkpoint or a Hugging Face folder (`mb.from_pretrained`).

    `backend` ("linen", "nnx") sets the three flags; left out, the
    checkpoint's config decides (base.yml's NNX for a Hugging Face folder).

    `adapters`: a LoRA run (or its checkpoints) trained on `path`, served
    beside it unmerged (its fingerprint checked; a QLoRA run's base is
    dequantized as training saw it).

    `engine.tokenizer` (`pretrained.TextTokenizer`: `.encode(text)`, `.decode(ids)`) is the model's own, as
    `maxbridge generate` and `serve` use it: the folder's tokenizer.json, or the one a run (the adapters' run
    first) keeps beside its config.yml; `tokenizer_path=` overrides it. Without one, UTF-8 bytes, with a warning.
    """
    if adapters is None:
      model = pretrained.from_pretrained(path, backend=backend, **overrides)
      engine = cls(model.config, model=model)
    else:
      base_config, params, tree, run_config = pretrained.base_and_adapters(path, adapters)
      keys = ("lora_rank", "lora_alpha", "lora_module_path", "lora_weight_qtype")
      config = base_config.replace(
          **pretrained.backend_overrides(backend), **{key: getattr(run_config, key) for key in keys}
      )
      engine = cls(config.replace(**overrides) if overrides else config, params, adapters=tree)
    source = adapters if adapters is not None and pretrained.tokenizer_folder(adapters) else path
    engine.tokenizer = pretrained.model_tokenizer(source, engine.config.vocab_size, overrides.get("tokenizer_path"))
    return engine

  def _adapters(self, adapters: Params) -> Params:
    """`adapters` checked against this engine's model and config, unrolled and sharded as their kernels."""

    if not lora.is_enabled(self.config):
      raise ValueError("adapters= needs the LoRA run's lora_rank and lora_alpha in the engine's config (lora_rank > 0)")
    abstract = lora.abstract_adapters(self.config, self._abstract_params, self.model.logical_axes())
    try:
      adapters = canonical.conform(adapters, abstract, self.config.param_scan_axis)
    except ValueError as e:
      raise ValueError(f"adapters do not fit this model and lora_rank={self.config.lora_rank}: {e}") from e
    axes = lora.adapter_axes(self.config, self._abstract_params, self.model.logical_axes())
    specs = jax.tree.map(lambda names: PartitionSpec(*names), axes, is_leaf=_is_axes)
    return jax.device_put(adapters, sharding.spec_tree_to_shardings(specs, self.mesh, self.config.logical_axis_rules))

  @property
  def max_concurrent_decodes(self) -> int:
    return self.config.per_device_batch_size * self.mesh.size

  def set_adapters(self, adapters: Params | None) -> None:
    """Serves `adapters` (a canonical adapter tree, scanned or not) from now on; None serves the base alone."""
    self.adapters = None if adapters is None else self._adapters(adapters)

  def _params(self, params: Params | None) -> tuple[Params, Params | None]:
    """(the engine's own parameters, or `params` unrolled to its layout; its adapters), as the compiled steps
    take them: `_weights` merges them there."""
    if params is not None:
      params = canonical.conform(params, self._abstract_params, self.config.param_scan_axis)
    return self.params if params is None else params, self.adapters

  def _weights(self, params: tuple[Params, Params | None]) -> Params:
    base, adapters = params
    if adapters is None:
      return base

    return lora.merge(self.config, base, adapters)

  # --- sampling ---------------------------------------------------------------------------------

  def _next_rng(self, rng):
    if rng is not None:
      return rng
    self._rng, rng = jax.random.split(self._rng)
    return rng

  @property
  def _greedy(self) -> bool:
    cfg = self.config
    return cfg.decode_sampling_strategy == "greedy" or cfg.decode_sampling_temperature == 0

  def _sample(self, logits, rng):
    cfg = self.config
    strategy = "greedy" if self._greedy else cfg.decode_sampling_strategy
    return sampling_ops.sample(
        logits,
        rng,
        strategy=strategy,
        temperature=cfg.decode_sampling_temperature,
        top_k=cfg.decode_sampling_top_k,
        nucleus_p=cfg.decode_sampling_nucleus_p,
    )

  # --- prefill: `Prefiller` runs each way ---------------------------------------------------------

  def prefill(
      self,
      tokens,
      true_length: int | None = None,
      *,
      existing_prefix: Prefix | None = None,
      params: Params | None = None,
      rng=None,
      images=None,
  ) -> Prefix:
    """One prompt (int [T], the first `true_length` real, the rest padding) -> its `Prefix`.

    `images` (use_multimodal=true): float32 [N, H, W, C], preprocessed (`interop.images`), whose soft tokens take
    the places of the prompt's image tokens, image after image.

    With `existing_prefix`, a chunk that continues that prefix (chunked
    prefill): its tokens take the positions after the prefix's. The prompt is
    padded to a power of two (at most max_prefill_predict_length), so prompts
    of nearby lengths share one compiled prefill.
    """
    return self._prefiller.one(tokens, true_length, existing_prefix, params, rng, num_samples=0, images=images)

  def score_prompt(self, tokens, top: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One prompt (int [T]) scored by the served weights: (the float32 log-probability of each token after
    the ones before it [T-1]; the `top` most likely tokens' log-probabilities and ids at each of those
    positions [T-1, top]), as echo with logprobs reports a prompt.

    One forward pass without a cache, the prompt padded as `prefill` pads it (padding comes after every real
    token, so no causal position sees it): nearby lengths share one compile.
    """
    tokens = self._prefiller.check_prompt(tokens)
    padded = self._prefiller.pad(tokens)
    scores = self._score_prompt(self._params(None), padded, np.int32(len(tokens)), top=top)
    return tuple(np.asarray(a)[: len(tokens) - 1] for a in scores)

  def _score_prompt_impl(self, params, tokens, length, *, top: int):
    offsets = jnp.arange(tokens.shape[0], dtype=jnp.int32)
    segment_ids = (offsets < length).astype(jnp.int32)  # padding: segment 0, as in `prefill`
    logits = self.model.apply(self._weights(params), tokens[None], offsets[None], segment_ids[None])[0]
    return score_tokens(logits[:-1], tokens[1:], top)

  def prefill_multisampling(
      self,
      tokens,
      true_length: int | None = None,
      num_samples: int = 1,
      *,
      params: Params | None = None,
      rng=None,
      images=None,
  ) -> Prefix:
    """One prefill, `num_samples` first tokens drawn from its logits (`Prefix.token` [num_samples]); `images` as
    `prefill`'s.

    `bulk_insert` of the prefix into `num_samples` slots gives each slot its own token.
    """
    if num_samples < 1:
      raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    return self._prefiller.one(tokens, true_length, None, params, rng, num_samples=int(num_samples), images=images)

  def prefill_concat(self, prompts, *, params: Params | None = None, rng=None) -> list[Prefix]:
    """Several prompts packed into one prefill (segment ids and positions per prompt) -> one `Prefix` each.

    Together they must fit max_prefill_predict_length. Each prefix is the one
    a separate `prefill` gives, up to float rounding.
    """
    return self._prefiller.concat(prompts, params, rng)

  def prefill_batch(self, prompts, *, params: Params | None = None, rng=None) -> list[Prefix]:
    """Several prompts prefilled side by side, one batch row each -> one `Prefix` each, for `insert`.

    What a server with several prompts waiting runs instead of one `prefill`
    per prompt: one compiled forward pass over [len(prompts), T] (T the longest
    prompt padded as `prefill` pads it). On accelerators its larger matmuls use
    the hardware better; on a 2-core CPU it measured no faster per token.
    Each prefix is the one a separate `prefill` gives, up to float rounding.
    """
    return self._prefiller.batch(prompts, params, rng)

  # --- decode slots -----------------------------------------------------------------------------

  def init_decode_state(self) -> DecodeState:
    """`max_concurrent_decodes` empty slots, each with a cache of max_target_length tokens (or a window's ring), sharded."""
    state = self._init_decode_state()
    self._positions.put(state.next_pos, np.zeros(self.max_concurrent_decodes, np.int32))
    return state

  def _abstract_decode_state(self) -> DecodeState:
    slots = self.max_concurrent_decodes
    return DecodeState(
        decoding.abstract_cache(self.config, slots, self.config.max_target_length),
        jax.ShapeDtypeStruct((slots,), jnp.int32),
        jax.ShapeDtypeStruct((slots,), jnp.int32),
        jax.ShapeDtypeStruct((slots, self.config.vocab_size), jnp.float32),
        jax.ShapeDtypeStruct((slots, self.config.vocab_size), jnp.int32),
    )

  def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int) -> DecodeState:
    """`prefix` into `slot`, replacing what the slot held; `decode_state` is donated."""
    return self.bulk_insert(prefix, decode_state, [slot])

  def bulk_insert(self, prefix: Prefix, decode_state: DecodeState, slots) -> DecodeState:
    """`prefix` into each of `slots` (one compiled insert per number of slots); `decode_state` is donated."""
    slots = self._check_slots(slots)
    samples = np.shape(prefix.token)
    if samples and samples[0] != len(slots):
      raise ValueError(f"a prefix of {samples[0]} samples goes into as many slots, got {len(slots)} slots {slots}")
    if len(set(slots)) != len(slots):
      raise ValueError(f"slots {slots} name a slot twice: each sample needs a slot of its own")
    self._prefiller.check_prefix(prefix)
    positions = self._positions.get(decode_state.next_pos).copy()
    positions[list(slots)] = self._positions.get(prefix.next_pos)
    state = self._insert(prefix, decode_state, jnp.asarray(slots, jnp.int32))
    self._positions.put(state.next_pos, positions)
    return state

  def release(self, decode_state: DecodeState, slots) -> DecodeState:
    """`slots` made idle (their requests are done); `decode_state` is donated.

    An idle slot stays at position 0, so `generate` goes on for the others
    however long they run; a finished slot left as it is would reach the end
    of its cache, and `generate` would refuse to step it. `insert` fills an
    idle slot as any other.
    """
    slots = self._check_slots(slots)
    positions = self._positions.get(decode_state.next_pos).copy()
    positions[list(slots)] = 0
    state = self._release(decode_state, jnp.asarray(slots, jnp.int32))
    self._positions.put(state.next_pos, positions)
    return state

  def _check_slots(self, slots) -> tuple[int, ...]:
    slots = tuple(int(s) for s in slots)
    count = self.max_concurrent_decodes
    for slot in slots:
      if not 0 <= slot < count:
        raise ValueError(f"slot {slot} is out of range: this engine has {count} slots, 0..{count - 1}")
    return slots

  def _insert_impl(self, prefix, state, slots):
    cache, tokens, next_pos, logits, counts = state
    prefix_cache = self._prefiller.unstacked(prefix.cache)
    for i, slot in enumerate(slots):  # traced slots: one compiled insert per number of slots
      cache = jax.tree.map(
          lambda whole, one, slot=slot: jax.lax.dynamic_update_slice_in_dim(whole, one, slot, 0),
          cache,
          prefix_cache,
      )
      token = prefix.token[i] if prefix.token.ndim else prefix.token
      tokens = tokens.at[slot].set(token)
      next_pos = next_pos.at[slot].set(prefix.next_pos)
      logits = logits.at[slot].set(prefix.logits)
      counts = counts.at[slot].set(0).at[slot, token].add(1)  # the first token is generated, not prompt
    return DecodeState(cache, tokens, next_pos, logits, counts)

  def generate(
      self, decode_state: DecodeState, *, params: Params | None = None, rng=None, sampling: SlotSampling | None = None
  ) -> tuple[DecodeState, jax.Array]:
    """One step for every slot: (new state, int32 [slots] the tokens sampled); `decode_state` is donated.

    A slot at position p writes its token there: with a cache of
    max_target_length tokens, a step of a slot at max_target_length is
    refused (ValueError naming the slot), as is a position past a learned
    position table; a ring that holds a whole sliding window has no end.
    The positions of a state this engine made are known on the host, so the
    check never waits for the step before.

    `sampling` samples each slot by its own settings instead of the
    decode_sampling_* keys (`rng` is then unused).
    """
    positions = self._check_room(decode_state, 1)
    # The engine's own key is split inside the step, not by a dispatch of its own on the host before it: one
    # call per step (the same keys as `_next_rng` draws). Greedy steps and `sampling` take no key at all.
    advance = rng is None and sampling is None and not self._greedy
    key = self._rng if advance else None if sampling is not None or self._greedy else rng
    with sharding.active(self.mesh, self.config.logical_axis_rules):  # activation constraints while tracing
      state, tokens, key = self._generate(self._params(params), decode_state, key, sampling, advance=advance)
    if advance:
      self._rng = key
    self._positions.put(state.next_pos, advanced(positions, 1))
    return state, tokens

  def _generate_impl(self, params, state, rng, sampling=None, *, advance: bool = False):
    carried = None
    if advance:
      carried, rng = jax.random.split(rng)
    return (*self._step(self._weights(params), state, rng, sampling), carried)

  def _step(self, params, state, rng, sampling=None):
    cache, tokens, next_pos, _, counts = state
    ones = jnp.ones_like(tokens)[:, None]
    logits, cache = self.model.cached_forward(params, cache, tokens[:, None], next_pos[:, None], ones)
    logits = logits[:, 0]
    new = self._sample(logits, rng) if sampling is None else sample_slots(logits, sampling, next_pos, counts)
    counts = counts.at[jnp.arange(new.shape[0]), new].add(1)
    # The model's logits, not the penalized ones: logprobs report them, as vLLM's default (raw_logprobs).
    state = DecodeState(cache, new, jnp.where(next_pos > 0, next_pos + 1, 0), logits, counts)  # idle slots stay idle
    return state, new

  def generate_steps(
      self, decode_state: DecodeState, num_steps: int, *, params: Params | None = None, rng=None
  ) -> tuple[DecodeState, jax.Array]:
    """`num_steps` of `generate` in one compiled loop: (new state, int32 [slots, num_steps]); state donated.

    Step i samples with `jax.random.split(rng, num_steps)[i]`, so it equals
    `generate` called with those keys; no token leaves the device in between.
    Refused, before any step runs, when a slot would pass the end of its cache
    (see `generate`).
    """
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps < 1:
      raise ValueError(f"num_steps must be a whole number >= 1, got {num_steps!r}")
    positions = self._check_room(decode_state, num_steps)
    with sharding.active(self.mesh, self.config.logical_axis_rules):
      state, tokens = self._generate_steps(self._params(params), decode_state, self._next_rng(rng), num_steps=num_steps)
    self._positions.put(state.next_pos, advanced(positions, num_steps))
    return state, tokens

  def _check_room(self, decode_state: DecodeState, steps: int) -> np.ndarray:
    """The slots' positions; refuses `steps` more steps when a busy slot would decode past `position_limit`.

    Checked on the host, before the compiled step: positions are exact there, and a step that ran past
    would not fail but overwrite the cache's last entry and decode on from a wrong one.
    """
    next_pos = self._positions.get(decode_state.next_pos)
    limit = self.position_limit
    if limit is None:
      return next_pos
    (over,) = np.nonzero((next_pos > 0) & (next_pos + steps > limit))
    if over.size:
      slot, pos = int(over[0]), int(next_pos[over[0]])
      raise ValueError(
          f"slot {slot} is at position {pos} and has room for {limit - pos} more step(s), not {steps}: "
          f"{limit_text(self.config, limit)}; insert a new prefix into it or release it"
      )
    return next_pos

  def _generate_steps_impl(self, params, state, rng, *, num_steps: int):
    params = self._weights(params)  # once, outside the loop
    state, tokens = jax.lax.scan(
        lambda state, rng: self._step(params, state, rng), state, jax.random.split(rng, num_steps)
    )
    return state, tokens.T


def _log_unquantized_states(config: Config) -> None:
  """Says where `quantize_kvcache` leaves a cache float: a recurrent layer's state (Qwen3-Next's DeltaNet).

  The int8 cache quantizes what attention appends, a token at a time, with one scale per token and
  head; a recurrent state is rewritten whole by every token, so its error would compound step by step.
  """
  if not config.quantize_kvcache:
    return
  cache = canonical.flatten(decoding.abstract_cache(config, 1, config.max_target_length))
  states = {
      name: leaf.dtype
      for name, leaf in ((path.rsplit("/", 1)[-1], leaf) for path, leaf in cache.items())
      if name in (kv_cache.RECURRENT_STATE, kv_cache.CONV_WINDOW)
  }
  if states:
    logging.info(
        "quantize_kvcache=true stores the attention layers' keys and values int8; the recurrent layers' "
        "states stay float: %s",
        ", ".join(f"{name} {dtype}" for name, dtype in sorted(states.items())),
    )


def generate_continuation(config: Config, model: Model, prompt, max_new_tokens: int, images=None) -> np.ndarray:
  """One prompt (int [T]) -> its `max_new_tokens` next tokens, on an engine of one slot: what `maxbridge generate` runs;
  `images` [N, H, W, C] fill its image tokens (`Engine.prefill`).

  Prefill, insert and `generate_steps`, sampled by `config`'s
  decode_sampling_* keys from its seed: the tokens an `Engine(config, ...)`
  of one slot gives. The engine is sized to the request: a prompt may pass
  max_prefill_predict_length, and prompt + continuation may pass
  max_target_length (warned, as `Model.generate` does: positions past it were
  never trained), though not a learned position table. With speculative_mtp_tokens > 0, greedy's same tokens come
  from self-speculative decoding (`serving.speculative`): drafted by the MTP modules, verified a block per forward.
  """
  prompt = np.asarray(prompt, np.int32)
  if max_new_tokens == 0:
    return np.zeros((0,), np.int32)
  total = len(prompt) + max_new_tokens
  table = config.trainable_position_size
  if table and total > table:  # as Model.generate bounds it
    raise ValueError(
        f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = {total} tokens: "
        f"trainable_position_size={table}, the positions this model has learned, ends at {table - 1}; "
        f"ask for at most {table - len(prompt)} new tokens"
    )
  if total > config.max_target_length:
    warnings.warn(
        f"prompt ({len(prompt)} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
        f"max_target_length={config.max_target_length}, the longest sequence this config trains on; positions "
        "past it were never trained, and quality usually drops there",
        stacklevel=2,
    )
  sized = config.replace(
      per_device_batch_size=1,
      max_prefill_predict_length=max(config.max_prefill_predict_length, len(prompt)),
      max_target_length=max(config.max_target_length, total),
  )
  if images is not None and config.speculative_mtp_tokens:
    raise ValueError("images with speculative_mtp_tokens > 0: self-speculative decoding takes text prompts only")
  if config.speculative_mtp_tokens:  # greedy's tokens, drafted by the MTP modules and verified a block at a time
    return speculative.generate(sized, model, prompt, max_new_tokens, config.speculative_mtp_tokens)[0]
  engine = Engine(sized, model=model)
  state = engine.insert(engine.prefill(prompt, images=images), engine.init_decode_state(), 0)
  first = np.asarray(state.tokens[:1])  # to host now: generate_steps donates the state it belongs to
  if max_new_tokens == 1:
    return first
  _, rest = engine.generate_steps(state, max_new_tokens - 1)
  return np.concatenate([first, np.asarray(rest[0])])
