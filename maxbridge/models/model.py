"""`mb.Model`: one interface over a Linen or an NNX top-level module.

Parameters cross this interface only as the canonical tree (a nested dict of
arrays, see DESIGN.md), so code written against `Model` never knows which
backend it drives.
"""

import abc
import functools
import math
import numbers
import warnings
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core import canonical
from maxbridge.core.config import Config
from maxbridge.models import decoding
from maxbridge.ops import vision

Params = dict[str, Any]


def default_inputs(tokens, positions=None, segment_ids=None):
  """Fills positions 0..T-1 and a single segment when not given."""
  tokens = jnp.asarray(tokens)
  if tokens.ndim != 2:
    raise ValueError(f"tokens must be int [batch, length], got shape {tokens.shape}")
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  if segment_ids is None:
    segment_ids = jnp.ones(tokens.shape, jnp.int32)
  return tokens, jnp.asarray(positions), jnp.asarray(segment_ids)


def check_inputs(config: Config, tokens, positions, what: str = "tokens") -> None:
  """Token ids in [0, vocab_size) and positions inside a learned position table, or a ValueError.

  Out of range, the embedding lookup would not fail: it gives NaN or another
  row's values. Checked on concrete arrays only (a traced call cannot look).
  """
  if not jnp.issubdtype(tokens.dtype, jnp.integer):
    raise ValueError(f"{what} must be integer token ids, got dtype {tokens.dtype}")
  if isinstance(tokens, jax.core.Tracer) or not tokens.size:
    return
  low, high = int(jnp.min(tokens)), int(jnp.max(tokens))
  if low < 0 or high >= config.vocab_size:
    bad = low if low < 0 else high
    raise ValueError(f"{what} hold token id {bad}, outside [0, vocab_size={config.vocab_size})")
  table = config.trainable_position_size
  if table and positions is not None and not isinstance(positions, jax.core.Tracer):
    if int(jnp.max(positions)) >= table or int(jnp.min(positions)) < 0:
      raise ValueError(
          f"positions run to {int(jnp.max(positions))}, past trainable_position_size={table} "
          f"(the learned position table holds 0..{table - 1})"
      )


def check_multimodal(config: Config, tokens, multimodal_input) -> None:
  """A ValueError naming what is wrong with `multimodal_input` for this model and these tokens, if anything."""
  if multimodal_input is None:
    return
  if not config.use_multimodal:
    raise ValueError(
        "multimodal_input (images) given to a model without a vision tower: set use_multimodal=true "
        f"(decoder_block={config.decoder_block!r})"
    )
  if not isinstance(multimodal_input, vision.MultimodalInput):
    raise ValueError(f"multimodal_input must be an ops.vision.MultimodalInput, got a {type(multimodal_input).__name__}")
  images, masks = multimodal_input
  vision.check_images(images, image_size=config.image_size_for_vit, channels=config.num_channels_for_vit)
  if images.shape[0] != tokens.shape[0]:
    raise ValueError(f"multimodal_input.images has {images.shape[0]} rows for {tokens.shape[0]} rows of tokens")
  if masks is not None and tuple(masks.shape) != tuple(images.shape[:2]):
    raise ValueError(f"multimodal_input.image_masks has shape {tuple(masks.shape)}; expected {tuple(images.shape[:2])}")
  vision.check_placeholders(
      tokens, images, masks, image_token=config.image_token_index, tokens_per_image=config.vision_output_length
  )


class Model(abc.ABC):
  """The same methods on both backends; see `LinenModel` and `NNXModel`."""

  def __init__(self, config: Config, module: Any, *, build: Callable[[Config], "Model"] | None = None):
    self.config = config
    self.module = module
    # Builds this model's twin for another config (`dispatch.abstract_model`), as decoding needs one with its
    # layers unrolled. Passed in: dispatch, which builds models, imports this module.
    self.build = build

  @abc.abstractmethod
  def abstract_params(self) -> Params:
    """Canonical tree of `jax.ShapeDtypeStruct`s."""

  @abc.abstractmethod
  def logical_axes(self) -> dict[str, Any]:
    """Canonical tree of logical axis-name tuples, one per parameter."""

  @abc.abstractmethod
  def params(self) -> Params:
    """The current parameters as a canonical pure dict of arrays."""

  @abc.abstractmethod
  def _set_params(self, params: Params) -> None:
    ...

  @abc.abstractmethod
  def _forward(self, params, tokens, positions, segment_ids, multimodal_input=None):
    """(logits, flat intermediates) as a pure function of canonical params."""

  @abc.abstractmethod
  def cached_forward(
      self, params: Params, cache: Params, tokens, positions, segment_ids, multimodal_input=None
  ) -> tuple[jax.Array, Params]:
    """(logits, updated cache): a forward pass that appends to and reads a canonical decode cache; a prefill may
    take images (`multimodal_input`).

    A pure function of canonical `params` and `cache` (see `maxbridge.engine`),
    for a jitted decode step; the model itself never holds a cache.
    """

  @abc.abstractmethod
  def cached_forward_hidden(self, params: Params, cache: Params, tokens, positions, segment_ids):
    """(logits, the decoder's last hidden states [B, T, D] before its final norm, updated cache): `cached_forward`
    with what multi-token prediction reads (self-speculative decoding, `maxbridge.serving.speculative`)."""

  def load_params(self, tree: Mapping[str, Any]) -> None:
    """Loads a canonical tree, scanned or unscanned; errors name any bad path."""
    self._set_params(canonical.conform(tree, self.abstract_params(), self.config.param_scan_axis))

  def apply(self, params: Params, tokens, positions=None, segment_ids=None, multimodal_input=None) -> jax.Array:
    """Logits as a pure, differentiable function of canonical `params`; `multimodal_input` (`ops.vision`): images."""
    inputs = default_inputs(tokens, positions, segment_ids)
    check_multimodal(self.config, inputs[0], multimodal_input)
    return self._forward(params, *inputs, multimodal_input)[0]

  def apply_with_intermediates(self, params: Params, tokens, positions=None, segment_ids=None, multimodal_input=None):
    """(logits, {"decoder/hidden_states": final normed hidden states [B, T, D]})."""
    inputs = default_inputs(tokens, positions, segment_ids)
    check_multimodal(self.config, inputs[0], multimodal_input)
    return self._forward(params, *inputs, multimodal_input)

  def logits(self, tokens, positions=None, segment_ids=None, multimodal_input=None) -> jax.Array:
    """int32 [B, T] -> float32 [B, T, V] with the current parameters; `multimodal_input`: images (`ops.vision`)."""
    tokens, positions, segment_ids = default_inputs(tokens, positions, segment_ids)
    check_inputs(self.config, tokens, positions)
    check_multimodal(self.config, tokens, multimodal_input)
    return self._jitted_apply(self.params(), tokens, positions, segment_ids, multimodal_input)

  def generate(self, prompt, max_new_tokens: int = 8, *, temperature: float = 0.0, seed: int = 0) -> jax.Array:
    """Continues int prompts [B, T] (or one prompt [T]); returns prompt + continuation [B, T + N].

    Greedy (argmax) at temperature 0, else sampled from softmax(logits / temperature)
    with `seed`. Runs on the engine's KV cache (`maxbridge.models.decoding.generate_tokens`):
    one prefill, then one cached step per token, in one compiled loop, with
    the layers unrolled (`decode_model`).
    """
    prompt = jnp.asarray(prompt)
    single = prompt.ndim == 1
    if single:
      prompt = prompt[None]
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer):
      raise ValueError(f"prompt must be int [batch, length] or [length], got {prompt.dtype} {prompt.shape}")
    if prompt.shape[1] == 0:
      raise ValueError("prompt must hold at least one token")
    check_inputs(self.config, prompt, None, what="prompt")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral):
      raise ValueError(f"max_new_tokens must be a whole number, got {max_new_tokens!r}")
    if max_new_tokens < 0:
      raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if not (isinstance(temperature, numbers.Real) and math.isfinite(temperature) and temperature >= 0):
      raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature!r}")
    total = prompt.shape[1] + max_new_tokens
    positions = self.config.trainable_position_size
    if positions and total > positions:
      raise ValueError(
          f"prompt ({prompt.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
          f"trainable_position_size={positions}, the positions this model has learned"
      )
    if total > self.config.max_target_length:
      # RoPE has no table to run out of: generating on is well defined, but past the trained length.
      warnings.warn(
          f"prompt ({prompt.shape[1]} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds "
          f"max_target_length={self.config.max_target_length}, the longest sequence this config trains "
          "on; positions past it were never trained, and quality usually drops there",
          stacklevel=2,
      )
    if max_new_tokens == 0:
      return prompt[0] if single else prompt
    out = self._jitted_generate(
        self.params(),
        prompt.astype(jnp.int32),
        jnp.float32(temperature),
        jax.random.key(seed),
        max_new_tokens=int(max_new_tokens),
        sample=temperature > 0,
    )
    return out[0] if single else out

  # Compiled functions live on the instance: a module-level cache keyed by
  # models would keep every model it has seen (and its parameters) alive.
  @functools.cached_property
  def _jitted_apply(self):
    return jax.jit(self.apply)

  @functools.cached_property
  def _jitted_generate(self):
    decoder = decode_model(self)
    abstract = decoder.abstract_params()

    def generate(params, *args, **kwargs):
      params = canonical.conform(params, abstract, self.config.param_scan_axis)  # unrolled layers, once per call
      return decoding.generate_tokens(decoder, params, *args, **kwargs)

    return jax.jit(generate, static_argnames=("max_new_tokens", "sample"))


def decode_model(model: Model) -> Model:
  """`model` itself when its layers are unrolled, else a twin of it that decodes with unrolled layers."""
  if not model.config.scan_layers:
    return model
  if model.build is None:
    raise ValueError("this model cannot build its decoding twin: make it with mb.create_model")
  twin = model.build(decoding.decode_config(model.config))
  twin.load_params(model.params())
  return twin


def generate_by_recompute(apply, params, prompt, temperature, key, *, max_new_tokens: int, sample: bool):
  """The reference for cached decoding (tests, benchmarks): each new token recomputes the whole sequence.

  One compiled loop over a buffer of fixed size; causal attention never reads
  the empty slots ahead. `apply` is `Model.apply`.
  """
  batch, length = prompt.shape
  buffer = jnp.zeros((batch, length + max_new_tokens), jnp.int32).at[:, :length].set(prompt)

  def step(i, carry):
    buffer, key = carry
    logits = apply(params, buffer)
    last = jax.lax.dynamic_index_in_dim(logits, length + i - 1, axis=1, keepdims=False)  # [B, V]
    if sample:
      key, subkey = jax.random.split(key)
      token = jax.random.categorical(subkey, last / temperature, axis=-1)
    else:
      token = jnp.argmax(last, axis=-1)
    buffer = jax.lax.dynamic_update_index_in_dim(buffer, token.astype(jnp.int32), length + i, axis=1)
    return buffer, key

  buffer, _ = jax.lax.fori_loop(0, max_new_tokens, step, (buffer, key))
  return buffer


def flat_intermediates(tree: Mapping[str, Any]) -> dict[str, jax.Array]:
  """Sown values are tuples (one entry per call); keep the last, keyed by path."""
  flat = {}
  for path, value in canonical.flatten(tree).items():
    path = path.removesuffix("/0")  # NNX flattens the sown tuple into a "0" key
    flat[path] = value[-1] if isinstance(value, tuple) else value
  return flat


def _abstract_variables(module: nn.Module, sample_inputs: tuple) -> dict:
  """The module's variables as shapes: a trace of its whole forward pass, so kept per equal module and input shapes
  (every model, trainer and engine of one config builds an equal Linen module; its boxes are never edited)."""
  shapes = tuple(None if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype) for x in sample_inputs)
  try:
    return _abstract_variables_of(module, shapes)
  except TypeError:  # a module with an unhashable field: traced each time
    return jax.eval_shape(module.init, jax.random.key(0), *shapes)


@functools.lru_cache(maxsize=64)
def _abstract_variables_of(module: nn.Module, shapes: tuple) -> dict:
  return jax.eval_shape(module.init, jax.random.key(0), *shapes)


class LinenModel(Model):
  """A Linen top-level module and its parameters (held here: Linen modules hold none)."""

  def __init__(self, config: Config, module: nn.Module, sample_inputs: tuple, **kwargs):
    super().__init__(config, module, **kwargs)
    self._boxed = _abstract_variables(module, sample_inputs)["params"]
    self._params: Params | None = None

  def abstract_params(self) -> Params:
    return canonical.unflatten(canonical.flatten(nn.unbox(self._boxed)))

  def boxed_params(self) -> Params:
    """Abstract parameters in their Linen logical-partitioning boxes."""
    return self._boxed

  def logical_axes(self) -> dict[str, Any]:
    specs = nn.get_partition_spec(self._boxed)
    return canonical.unflatten({p: tuple(s) for p, s in canonical.flatten(specs).items()})

  def params(self) -> Params:
    # A fresh tree: a caller editing it must not edit the model.
    return canonical.unflatten(canonical.flatten(self._params))

  def _set_params(self, params: Params) -> None:
    self._params = params

  def _forward(self, params, tokens, positions, segment_ids, multimodal_input=None):
    return linen_forward(self.module, {"params": params}, tokens, positions, segment_ids, multimodal_input)

  def cached_forward(self, params, cache, tokens, positions, segment_ids, multimodal_input=None):
    variables = {"params": params, "cache": cache}
    images = {} if multimodal_input is None else {"multimodal_input": multimodal_input}
    logits, state = self.module.apply(variables, tokens, positions, segment_ids, mutable=["cache"], **images)
    return logits, canonical.unflatten(canonical.flatten(nn.unbox(state["cache"])))

  def cached_forward_hidden(self, params, cache, tokens, positions, segment_ids):
    variables = {"params": params, "cache": cache}
    logits, state = self.module.apply(variables, tokens, positions, segment_ids, mutable=["cache", "intermediates"])
    hidden = flat_intermediates(state["intermediates"])["decoder/hidden_states"]
    return logits, hidden, canonical.unflatten(canonical.flatten(nn.unbox(state["cache"])))


class NNXModel(Model):
  """An NNX top-level module; it holds its own parameters."""

  def abstract_params(self) -> Params:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self._pure_params())

  def logical_axes(self) -> dict[str, Any]:
    flat = {
        "/".join(map(str, path)): tuple(var.get_metadata().get("out_sharding") or ())
        for path, var in nnx.to_flat_state(nnx.state(self.module, nnx.Param))
    }
    return canonical.unflatten(flat)

  def params(self) -> Params:
    return self._pure_params()

  def _pure_params(self) -> Params:
    pure = nnx.to_pure_dict(nnx.state(self.module, nnx.Param))
    return canonical.unflatten(canonical.flatten(pure))

  def _set_params(self, params: Params) -> None:
    nnx.update(self.module, params)

  def _forward(self, params, tokens, positions, segment_ids, multimodal_input=None):
    # Parameters plus the rest (caches, statistics, anything not a Param): the
    # forward pass reads them all. Replacing the parameters makes new
    # Variables, so the module's own are never touched.
    graphdef, state, rest = nnx.split(self.module, nnx.Param, ...)
    nnx.replace_by_pure_dict(state, params)
    return nnx_forward(graphdef, state, rest, tokens, positions, segment_ids, multimodal_input)

  def cached_forward(self, params, cache, tokens, positions, segment_ids, multimodal_input=None):
    graphdef, state, rest = nnx.split(self.module, nnx.Param, ...)
    nnx.replace_by_pure_dict(state, params)
    module = nnx.merge(graphdef, state, rest, copy=True)
    # The cache joins this trace's copy as nnx.Cache variables at their
    # canonical paths; the live model never gets any.
    nnx.update(module, nnx.State(jax.tree.map(nnx.Cache, cache)))
    images = {} if multimodal_input is None else {"multimodal_input": multimodal_input}
    logits = module(tokens, positions, segment_ids, **images)
    pure = nnx.to_pure_dict(nnx.state(module, nnx.Cache))
    return logits, canonical.unflatten(canonical.flatten(pure))

  def cached_forward_hidden(self, params, cache, tokens, positions, segment_ids):
    graphdef, state, rest = nnx.split(self.module, nnx.Param, ...)
    nnx.replace_by_pure_dict(state, params)
    module = nnx.merge(graphdef, state, rest, copy=True)
    nnx.update(module, nnx.State(jax.tree.map(nnx.Cache, cache)))
    logits = module(tokens, positions, segment_ids)
    hidden = flat_intermediates(nnx.to_pure_dict(nnx.state(module, nnx.Intermediate)))["decoder/hidden_states"]
    pure = nnx.to_pure_dict(nnx.state(module, nnx.Cache))
    return logits, hidden, canonical.unflatten(canonical.flatten(pure))


def linen_forward(module: nn.Module, variables: Mapping[str, Any], tokens, positions, segment_ids, multimodal_input=None):
  """(logits, flat intermediates) of a Linen top-level module: the one forward pass of `Model` and the trainer."""
  images = {} if multimodal_input is None else {"multimodal_input": multimodal_input}
  logits, state = module.apply(variables, tokens, positions, segment_ids, mutable=["intermediates"], **images)
  return logits, flat_intermediates(state.get("intermediates", {}))


def nnx_forward(
    graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, tokens, positions, segment_ids, multimodal_input=None
):
  """(logits, flat intermediates) of an NNX top-level module given as split state: the one forward pass of
  `Model` and the trainer. `params` is the state differentiated, `rest` everything else the module holds."""
  # copy=True: the forward pass writes (sown values, layer state) into the
  # module it runs, and `rest` belongs to the caller: a live model, or an
  # outer trace whose Variables must not receive this trace's values.
  module = nnx.merge(graphdef, params, rest, copy=True)
  images = {} if multimodal_input is None else {"multimodal_input": multimodal_input}
  logits = module(tokens, positions, segment_ids, **images)
  return logits, flat_intermediates(nnx.to_pure_dict(nnx.state(module, nnx.Intermediate)))
