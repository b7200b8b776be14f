"""The one place that reads `pure_nnx`, `enable_nnx` and `pure_nnx_decoder`.

    pure_nnx          the train state and step (and so the top-level module): NNX vs Linen
    enable_nnx        the top-level model (embedder, wiring): NNX vs Linen
    pure_nnx_decoder  the decoder stack: NNX vs Linen

A Linen part inside an NNX part is wrapped with `bridge.ToNNX`, an NNX part
inside a Linen part with `bridge.ToLinen`. Every combination declares the same
canonical parameter tree.
"""

import functools
from typing import Any, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import FrozenDict

from linen_models import decoders as linen_decoders
from linen_models import models as linen_models
from linen_models import mtp as linen_mtp
from maxbridge.core import bridge, canonical, initializers
from maxbridge.core.config import Config
from maxbridge.core.quantization_policy import serves_quantized
from maxbridge.ops import quantization
from maxbridge.models import quantized
from maxbridge.models.model import LinenModel, Model, NNXModel
from nnx_models import decoders as nnx_decoders
from nnx_models import models as nnx_models
from nnx_models import mtp as nnx_mtp

FLAGS = ("pure_nnx", "enable_nnx", "pure_nnx_decoder")
# Named backends: every part in Linen, or every part in NNX.
BACKENDS = {"linen": (False, False, False), "nnx": (True, True, True)}


def backend_flags(backend: str | tuple[bool, bool, bool]) -> dict[str, bool]:
  """The three flags as config keys, for a named backend ("linen", "nnx") or a tuple in `FLAGS` order."""
  if isinstance(backend, str):
    if backend not in BACKENDS:
      raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {backend!r}")
    backend = BACKENDS[backend]
  return dict(zip(FLAGS, backend, strict=True))


def nnx_train_state(config: Config) -> bool:
  """Whether the train state and step are NNX's (`TrainStateNNX`) rather than Linen's (`pure_nnx`)."""
  return config.pure_nnx


def sample_inputs(config: Config) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Smallest (tokens, positions, segment_ids) that initialise a Transformer."""
  ones = jnp.ones((1, 1), jnp.int32)
  return ones, ones - 1, ones


def _decoder_sample_inputs(config: Config) -> tuple:
  x = jnp.zeros((1, 1, config.emb_dim), jnp.dtype(config.dtype))
  table = jnp.zeros((config.vocab_size, config.emb_dim), jnp.dtype(config.weight_dtype))
  tokens, positions, segment_ids = sample_inputs(config)
  return x, positions, segment_ids, table if config.logits_via_embedding else None, tokens


# Qwix (`quantized.quantize_linen` / `quantize_nnx`) intercepts the
# decoder, in the decoder's own backend: it finds a matmul's weights through
# the module running it, which a ToNNX/ToLinen boundary would hide from an
# interception of the whole model. The top-level model's own ops (the
# embedding lookup) are outside the rules anyway.
def linen_decoder(config: Config) -> nn.Module:
  if config.pure_nnx_decoder:
    return bridge.ToLinen(quantized_nnx_decoder, kwargs=FrozenDict(config=config))
  return quantized.quantize_linen(config, linen_decoders.Decoder(config), decoder_path="decoder")


def quantized_nnx_decoder(config: Config, *, rngs: nnx.Rngs) -> nnx.Module:
  """The NNX `Decoder`, quantized by Qwix when the config asks."""
  return quantized.quantize_nnx(config, nnx_decoders.Decoder(config, rngs=rngs))


def nnx_decoder(config: Config, rngs: nnx.Rngs) -> nnx.Module:
  if config.pure_nnx_decoder:
    return quantized_nnx_decoder(config, rngs=rngs)
  decoder = quantized.quantize_linen(config, linen_decoders.Decoder(config), decoder_path="")
  return bridge.ToNNX(decoder, rngs=rngs).lazy_init(*_decoder_sample_inputs(config))


def linen_transformer(config: Config) -> nn.Module:
  """The Linen top-level model: a Linen Transformer, or an NNX one behind a ToLinen."""
  if config.enable_nnx:
    factory = functools.partial(nnx_decoder, config)
    return bridge.ToLinen(nnx_models.Transformer, kwargs=FrozenDict(config=config, decoder_factory=factory))
  return linen_models.Transformer(config, decoder=linen_decoder(config))


def nnx_transformer(config: Config, rngs: nnx.Rngs) -> nnx.Module:
  """The NNX top-level model: an NNX Transformer, or a Linen one behind a ToNNX."""
  if config.enable_nnx:
    return nnx_models.Transformer(config, functools.partial(nnx_decoder, config), rngs=rngs)
  return bridge.ToNNX(linen_transformer(config), rngs=rngs).lazy_init(*sample_inputs(config))


def mtp_drafter(config: Config, k: int):
  """Self-speculative decoding's draft step of MTP module k, on the decoder's backend, as a pure function.

  (params, cache, hidden, embedded, positions, segment_ids, embedding) -> (logits, hidden, cache): `params` the
  decoder's `mtp/mtp_layer_{k}` (its own final norm included) and `logits_dense` at those names, `cache` module k's own
  (`{"mtp_layer_{k}": {"layer": {"self_attention": ...}}}`), `embedding` the token table where the head is tied.
  """
  if config.pure_nnx_decoder:
    layer = nnx_decoders.layer_classes(config)[config.family.mtp_stack(config).name]
    abstract = nnx.eval_shape(lambda: nnx_mtp.MTPDrafter(config, layer, k, rngs=nnx.Rngs(params=0)))
    graphdef, abstract_params, rest = nnx.split(abstract, nnx.Param, ...)

    def nnx_apply(params, cache, *inputs):
      state = jax.tree.map(lambda x: x, abstract_params)
      nnx.replace_by_pure_dict(state, params)
      module = nnx.merge(graphdef, state, rest, copy=True)
      nnx.update(module, nnx.State(jax.tree.map(nnx.Cache, cache)))
      logits, hidden = module(*inputs)
      return logits, hidden, canonical.unflatten(canonical.flatten(nnx.to_pure_dict(nnx.state(module, nnx.Cache))))

    return nnx_apply
  layer = linen_decoders.layer_classes(config)[config.family.mtp_stack(config).name]
  module = linen_mtp.MTPDrafter(config, layer, k)

  def linen_apply(params, cache, *inputs):
    (logits, hidden), state = module.apply({"params": params, "cache": cache}, *inputs, mutable=["cache"])
    return logits, hidden, canonical.unflatten(canonical.flatten(nn.unbox(state["cache"])))

  return linen_apply


def create_model(config: Config, seed: int | None = None, *, params: Mapping[str, Any] | None = None) -> Model:
  """The model for `config`'s flags, with canonical initial parameters for `seed`.

  Parameters come from `initializers.init_params` (seed + canonical path), not
  from either backend's RNG streams, so every flag combination starts equal.
  Given `params` (a canonical tree, e.g. an imported checkpoint), the model
  takes those instead and no initial values are ever computed.
  """
  model = abstract_model(config)
  if params is None and serves_quantized(config):
    # A serve model starts from the float model of the same seed, converted.
    params = quantize_params(
        config, create_model(config.replace(quantization="", checkpoint_is_quantized=False), seed).params()
    )
  if params is not None:
    if quantization.is_serve_tree(params) and not config.checkpoint_is_quantized:
      raise ValueError(
          "these parameters are quantized for serving (kernel_qvalue/kernel_scale in place of float kernels): "
          "load them with checkpoint_is_quantized=true and the quantization they were made with"
      )
    model.load_params(params)
    return model
  spec = tuple((path, leaf.shape, leaf.dtype.name) for path, leaf in canonical.flatten(model.abstract_params()).items())
  init = initializers.jitted_init(spec, initializers.InitOptions.from_config(config))
  model.load_params(init(config.seed if seed is None else seed))
  return model


def abstract_model(config: Config) -> Model:
  """The model for `config`, its parameters not yet written (NNX: abstract; Linen: none held)."""
  if config.pure_nnx:
    # Abstract: the real values are written once, by load_params. A new module (new Variables) each call.
    return NNXModel(config, nnx.merge(*_abstract_nnx(config)), build=abstract_model)
  return LinenModel(config, linen_transformer(config), sample_inputs(config), build=abstract_model)


@functools.lru_cache(maxsize=64)
def _abstract_nnx(config: Config) -> tuple[nnx.GraphDef, nnx.State]:
  """The NNX transformer of `config`, split, with shapes for values. Building it (an abstract trace of every
  layer's construction) took ~0.5 s for a tiny Gemma 4, and every model, trainer and engine of a config builds
  one; merging the split module again takes a fraction of that."""
  return nnx.split(nnx.eval_shape(lambda: nnx_transformer(config, nnx.Rngs(params=0))))


def quantize_params(config: Config, params: Mapping[str, Any]) -> dict[str, Any]:
  """The serve-mode tree of `config` (`checkpoint_is_quantized=true`) from a float canonical tree.

  AQT convert mode (`use_qwix_quantization=false`) or Qwix PTQ (true). `params`
  may be scanned or not; the result is in `config`'s scan form. Each quantized
  kernel becomes `kernel_qvalue` + per-channel `kernel_scale` (per layer in a
  stack); everything else (norms, embeddings, biases) is copied as is.
  """
  if not serves_quantized(config):
    raise ValueError(
        "quantize_params makes serve weights: it needs quantization set and checkpoint_is_quantized=true (got "
        f"quantization={config.quantization!r}, checkpoint_is_quantized={str(config.checkpoint_is_quantized).lower()})"
    )
  if quantization.is_serve_tree(params):
    raise ValueError("these parameters are already quantized (kernel_qvalue/kernel_scale in place of float kernels)")
  float_abstract = abstract_model(config.replace(quantization="", checkpoint_is_quantized=False)).abstract_params()
  params = canonical.conform(params, float_abstract, config.param_scan_axis)
  return quantized.serve_tree(config, params, abstract_model(config).abstract_params())
