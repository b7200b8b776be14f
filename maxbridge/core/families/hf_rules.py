"""The Hugging Face side of a family entry: tensor `Rule`s, their transforms, and config readers.

A `Rule` is a Hugging Face tensor name pattern, the canonical path it becomes
and a `Transform` (transpose, head reshape, query scaling). In patterns,
`{layer}` is the Hugging Face layer index and, in canonical paths, that
layer's unscanned path (`decoder/layers_3`, or DeepSeek's `decoder/moe_layers_0`);
`{expert}` marks per-expert Hugging Face tensors stacked on axis 0 of one
canonical array. Each family module holds its tables and config translations
(`HFFamily`); `maxbridge.interop.hf.mapping` applies them, and nothing outside
these modules knows a Hugging Face name.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

from maxbridge.core.families.base import Config, query_kernel_carries_scale

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Kept beside an imported checkpoint, so an export gives back the keys we do not model.
HF_CONFIG_SIDECAR = "hf_config.json"


class HFError(ValueError):
  """A Hugging Face folder, config or tensor that cannot be mapped; the message names it."""


# --- transforms --------------------------------------------------------------------------
# Each works on numpy/jax arrays and on tracers alike (methods only), so the
# expected Hugging Face shapes come from jax.eval_shape of the export direction.


@dataclasses.dataclass(frozen=True)
class Copy:
  """Same values, same shape (norm scales, embeddings, biases of one axis)."""

  def to_ours(self, x, shape, config):
    return x.reshape(shape)

  def to_hf(self, x, config):
    return x


@dataclasses.dataclass(frozen=True)
class Reshape:
  """Flat Hugging Face layout -> our named axes; `in_ndim` of ours form its leading axis.

  GPT-2's Conv1D weights are already [in, out]; `in_ndim=None` flattens to one axis (biases).
  """

  in_ndim: int | None = None

  def to_ours(self, x, shape, config):
    return x.reshape(shape)

  def to_hf(self, x, config):
    if self.in_ndim is None:
      return x.reshape(-1)
    return x.reshape(math.prod(x.shape[: self.in_ndim]), -1)


@dataclasses.dataclass(frozen=True)
class Linear:
  """torch.nn.Linear weight [out, in] <-> our kernel [*in, *out] (`in_ndim` leading axes).

  `scale(cfg)` multiplies on import and divides on export: the query kernel
  carries 1/sqrt(head_dim) in MaxText's numerics (see DESIGN.md).
  """

  in_ndim: int = 1
  scale: Callable[[Config], float | None] = lambda config: None

  def to_ours(self, x, shape, config):
    kernel = x.T.reshape(shape)
    factor = self.scale(config)
    return kernel if factor is None else kernel * factor

  def to_hf(self, x, config):
    factor = self.scale(config)
    if factor is not None:
      x = x / factor
    return x.reshape(math.prod(x.shape[: self.in_ndim]), -1).T


@dataclasses.dataclass(frozen=True)
class SwappedHalves:
  """torch.nn.Linear weight [out, 2 * in] <-> our kernel [2 * in, out], the two input halves in the other order.

  DeepSeek-V3's MTP `eh_proj` reads [enorm(embedding); hnorm(hidden)]; our
  `projection` reads [hidden_norm(hidden); embedding_norm(embedding)], MaxText's order.
  """

  def to_ours(self, x, shape, config):
    return x.T[(_swap(shape[0]),)].reshape(shape)

  def to_hf(self, x, config):
    return x[(_swap(x.shape[0]),)].T


@dataclasses.dataclass(frozen=True)
class Part:
  """Part `index` of `count` equal slices, along `axis`, of one Hugging Face tensor that several rules share.

  Llama 4's experts.gate_up_proj [E, D, 2F] holds MaxText's wi_0 (gate) then
  wi_1 (up): two rules name it, each with its `Part`. Import slices; export
  joins the parts in index order (`mapping.to_hf_tensors`). The parts stay two
  parameters so that tensor parallelism shards each without a reshard.
  """

  index: int
  count: int
  axis: int = -1

  def to_ours(self, x, shape, config):
    size = x.shape[self.axis] // self.count
    where = [slice(None)] * x.ndim
    where[self.axis] = slice(self.index * size, (self.index + 1) * size)
    return x[tuple(where)].reshape(shape)

  def to_hf(self, x, config):
    return x


@dataclasses.dataclass(frozen=True)
class Piece:
  """One of several Hugging Face tensors that make up one canonical array (`Part` the other way round).

  Qwen3.5 stores the gated DeltaNet's input projection as in_proj_qkv and
  in_proj_z, where the canonical tree (Qwen3-Next's, as MaxText's Qwen3.5
  keeps it) holds one in_proj_qkvz, each key head's columns together. Several
  rules name the canonical path, each with its `Piece`: import maps each
  tensor to its piece (`inner` given the piece's shape) and joins the pieces
  along `axis` in index order (`mapping.from_hf_tensors`); export cuts piece
  `index` out and hands it to `inner`. `widths(config)` are all the pieces'
  widths along `axis`.
  """

  index: int
  widths: Callable[[Config], tuple[int, ...]]
  inner: Any = Linear()
  axis: int = -1

  def to_ours(self, x, shape, config):
    shape = list(shape)
    shape[self.axis] = self.widths(config)[self.index]
    return self.inner.to_ours(x, tuple(shape), config)

  def to_hf(self, x, config):
    widths = self.widths(config)
    start = sum(widths[: self.index])
    where = [slice(None)] * x.ndim
    where[self.axis] = slice(start, start + widths[self.index])
    return self.inner.to_hf(x[tuple(where)], config)


def _swap(rows: int) -> list[int]:
  half = rows // 2
  return [*range(half, rows), *range(half)]


def query_scale(config: Config) -> float | None:
  """`Linear`'s scale for a query kernel: 1/sqrt(head_dim) where the kernel carries it (`query_kernel_carries_scale`)."""
  # Where the kernel cannot carry the factor, attention applies it at run time instead.
  return config.head_dim**-0.5 if query_kernel_carries_scale(config) else None


@dataclasses.dataclass(frozen=True)
class Rule:
  hf: str
  ours: str
  transform: Any = Copy()


@dataclasses.dataclass(frozen=True)
class ConfigClass:
  """What one transformers config class does to config.json before its model reads a field.

  transformers fills an absent field with the class default (which differs by
  family: Qwen3's head_dim is 128, Mixtral's rope theta 1e6), lets an
  `attribute_map` alias override the field it names, and rebuilds RoPE from
  `rope_scaling`, `rope_parameters` and `rope_theta` (`rope_parameters`).
  `maxbridge/interop/hf/FIELDS.md` lists what each family does with every field.
  """

  name: str  # the transformers class, e.g. "LlamaConfig" (tests compare `defaults` with its own)
  defaults: Mapping[str, Any]  # its defaults of the fields its model reads
  aliases: Mapping[str, str] = dataclasses.field(default_factory=dict)  # attribute_map: alias -> field
  default_theta: float = 10000.0  # RoPE's theta when config.json gives none

  def read(self, hf: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's fields as the class holds them: defaults filled in, aliases applied."""
    for key in REFUSED_EVERYWHERE:
      if hf.get(key) is not None:
        raise HFError(f"{CONFIG_FILE}: {key} is set; {REFUSED_EVERYWHERE[key]}")
    values = {**self.defaults, **hf}
    # An alias is set after the fields, so it wins when both spellings are given.
    values.update({field: hf[alias] for alias, field in self.aliases.items() if alias in hf})
    return values


# Generic fields that change what any model computes, and why maxbridge refuses them.
REFUSED_EVERYWHERE = {
    "quantization_config": "maxbridge reads unquantized weights only (quantize after import: maxbridge quantize)",
    "per_layer_config": "layers that differ from one another (heterogeneous configs) are not supported",
}


@dataclasses.dataclass(frozen=True)
class HFFamily:
  """How one Hugging Face architecture maps onto one `decoder_block`."""

  model_type: str  # Hugging Face's config.json "model_type"
  architecture: str  # the *ForCausalLM class transformers builds
  decoder_blocks: tuple[str, ...]  # ours, exported as this family
  rules: tuple[Rule, ...]
  config_from_hf: Callable[[Mapping[str, Any]], dict[str, Any]]
  config_to_hf: Callable[[Config], dict[str, Any]]
  config_class: ConfigClass  # how transformers reads this architecture's config.json
  # Hugging Face name -> the spelling the rules use (older checkpoints differ).
  normalize_name: Callable[[str], str] = lambda name: name
  # Tensors that carry nothing (saved causal-mask buffers): skipped on import.
  ignored: tuple[str, ...] = ()
  # The `normalize_embedding_logits` that computes this architecture's tied head: false for
  # every transformers model but Gemma's, whose canonical table holds sqrt(d) x its embedding.
  normalize_embedding_logits: bool = False
  # Multi-token prediction (DeepSeek-V3): module k is Hugging Face layer num_hidden_layers + k - 1. Rules whose
  # canonical path starts with "{mtp}/" map module k's own tensors (under decoder/mtp/mtp_layer_{k}); the
  # family's "{layer}/" rules map its decoder layer. `mtp_copies`: Hugging Face tensors of each MTP layer that
  # hold one of the model's own (canonical path): written on export, refused on import where they differ.
  mtp_copies: Mapping[str, str] = dataclasses.field(default_factory=dict)
  # Whether a config of one of `decoder_blocks` exports as this architecture, where a decoder block has more than
  # one (DeepSeek-V2 for softmax routing, else DeepSeek-V3): the first that takes it.
  exports: Callable[[Config], bool] = lambda config: True
  # A multimodal architecture's tensors -> (its language model's alone, named as the text architecture of the same
  # decoder block names them; the names left out): a text-only model (use_multimodal=false) from its folder.
  language_model: Callable[[Mapping[str, Any]], tuple[dict[str, Any], list[str]]] | None = None


def family_for_config(config: Config) -> HFFamily:
  """The Hugging Face architecture `cfg` exports as."""
  for family in config.family.hf:
    if config.decoder_block in family.decoder_blocks and family.exports(config):
      return family
  raise HFError(f"decoder_block={config.decoder_block!r} has no Hugging Face export")


# --- config.json readers: each error names the field -----------------------------------------


def get(hf: Mapping[str, Any], key: str, default: Any = ..., *, where: str = CONFIG_FILE) -> Any:
  if key in hf and hf[key] is not None:
    return hf[key]
  if default is ...:
    raise HFError(f"{where} has no {key!r}, which the model needs")
  return default


def get_int(hf: Mapping[str, Any], key: str, default: Any = ...) -> int:
  """An integer field; a string, float or bool there is an error naming the field, not a guess."""
  value = get(hf, key, default)
  if isinstance(value, bool) or not isinstance(value, int):
    raise HFError(f"{CONFIG_FILE}: {key}={value!r} must be an integer")
  return value


def get_float(hf: Mapping[str, Any], key: str, default: Any = ...) -> float:
  value = get(hf, key, default)
  if isinstance(value, bool) or not isinstance(value, (int, float)):
    raise HFError(f"{CONFIG_FILE}: {key}={value!r} must be a number")
  return float(value)


def get_bool(hf: Mapping[str, Any], key: str, default: Any = ...) -> bool:
  """A JSON true/false; the string "false" must not read as true."""
  value = get(hf, key, default)
  if not isinstance(value, bool):
    raise HFError(f"{CONFIG_FILE}: {key}={value!r} must be true or false")
  return value


def head_dim(hf: Mapping[str, Any], width_key: str, heads_key: str) -> int:
  """head_dim when given, else width / heads, which must divide exactly."""
  width, heads = get_int(hf, width_key), get_int(hf, heads_key)
  if hf.get("head_dim") is not None:
    return get_int(hf, "head_dim")
  if heads <= 0 or width % heads:
    raise HFError(
        f"{CONFIG_FILE}: {width_key}={width} is not a multiple of {heads_key}={heads}, and no head_dim is given"
    )
  return width // heads


def require(hf: Mapping[str, Any], key: str, supported: Any, default: Any) -> None:
  value = hf.get(key, default)
  if value is None:
    value = default
  if value != supported:
    raise HFError(f"{CONFIG_FILE}: {key}={value!r} is not supported; maxbridge models {key}={supported!r}")


def require_one_of(hf: Mapping[str, Any], key: str, supported: tuple[Any, ...]) -> None:
  """`key` is one of `supported`, spellings transformers computes alike (silu and swish)."""
  if hf.get(key) not in supported:
    listed = " or ".join(map(repr, supported))
    raise HFError(f"{CONFIG_FILE}: {key}={hf.get(key)!r} is not supported; maxbridge models {key}={listed}")


# Hugging Face's Llama 3.1 scaling parameters, by our config keys.
_LLAMA3_KEYS = {
    "rope_factor": "factor",
    "rope_low_freq_factor": "low_freq_factor",
    "rope_high_freq_factor": "high_freq_factor",
    "original_max_position_embeddings": "original_max_position_embeddings",
}


def rope_parameters(hf: Mapping[str, Any], default_theta: float) -> tuple[dict[str, Any], str]:
  """(RoPE parameters, the field they came from), as transformers 5.x's config classes build them.

  A non-empty `rope_scaling` replaces `rope_parameters` whole (it does not
  merge); the top-level `rope_theta` (else the class's default) and
  `partial_rotary_factor` fill in what the chosen dict lacks; `type` is the
  older spelling of `rope_type`; Llama 3.1's original_max_position_embeddings
  defaults to max_position_embeddings.
  """
  for key in ("rope_parameters", "rope_scaling"):
    if hf.get(key) is not None and not isinstance(hf[key], Mapping):
      raise HFError(f"{CONFIG_FILE}: {key}={hf[key]!r} must be an object")
  source = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  parameters = dict(hf.get(source) or {})
  parameters.setdefault("rope_theta", hf.get("rope_theta", default_theta))
  if "partial_rotary_factor" in hf:
    parameters.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
  parameters.setdefault("rope_type", parameters.get("type", "default"))
  if parameters["rope_type"] in ("llama3", "yarn", "longrope"):
    parameters.setdefault("original_max_position_embeddings", hf.get("max_position_embeddings"))
  return parameters, source


def rope_from_hf(
    hf: Mapping[str, Any], *, llama3: bool, default_theta: float, partial_rotary_default: float | None = None
) -> dict[str, Any]:
  """Our RoPE keys for config.json's (`rope_parameters`): default RoPE, and Llama 3.1's scaling where `llama3`.

  A family that rotates part of each head passes its class's `partial_rotary_default`: the fraction is then read
  (`partial_rotary_factor`), where every other family refuses one that is not 1."""
  parameters, source = rope_parameters(hf, default_theta)
  rope_type = parameters["rope_type"]
  supported = ("default", "llama3") if llama3 else ("default",)
  if rope_type not in supported:
    spelling = "rope_type" if "rope_type" in (hf.get(source) or {}) else "type"
    replaced = " (transformers reads rope_scaling in place of rope_parameters)" if source == "rope_scaling" else ""
    raise HFError(
        f"{CONFIG_FILE}: {source}.{spelling}={rope_type!r} is not supported{replaced}; maxbridge implements "
        f"{' and '.join(map(repr, supported))} here"
    )
  if partial_rotary_default is None and parameters.get("partial_rotary_factor", 1.0) != 1.0:
    fraction = parameters["partial_rotary_factor"]
    raise HFError(f"{CONFIG_FILE}: partial_rotary_factor={fraction!r} is not supported; maxbridge rotates whole heads")
  theta = parameters["rope_theta"]
  if isinstance(theta, bool) or not isinstance(theta, (int, float)) or not math.isfinite(theta):
    raise HFError(f"{CONFIG_FILE}: {source}.rope_theta={theta!r} must be a number")
  if float(theta) != int(theta):
    raise HFError(f"{CONFIG_FILE}: rope_theta={theta!r} must be a whole number (rope_max_timescale)")
  values: dict[str, Any] = {"rope_max_timescale": int(theta), "rope_type": "default"}
  if rope_type == "llama3":
    missing = [name for name in _LLAMA3_KEYS.values() if parameters.get(name) is None]
    if missing:
      raise HFError(f"{CONFIG_FILE}: rope_type 'llama3' needs {', '.join(missing)} in {source}")
    values.update(rope_type="llama3.1", rope_use_scale=True)
    values.update({ours: parameters[theirs] for ours, theirs in _LLAMA3_KEYS.items()})
  if partial_rotary_default is not None:
    values["partial_rotary_factor"] = get_float(parameters, "partial_rotary_factor", partial_rotary_default)
  return values


def common_to_hf(config: Config, layers: int | None = None) -> dict[str, Any]:
  """The config.json fields every decoder family spells alike (`layers` where a family counts its own)."""
  return {
      "hidden_size": config.emb_dim,
      "num_attention_heads": config.num_query_heads,
      "num_key_value_heads": config.num_kv_heads,
      "head_dim": config.head_dim,
      "intermediate_size": config.mlp_dim,
      "num_hidden_layers": config.num_decoder_layers if layers is None else layers,
      "vocab_size": config.vocab_size,
      "rms_norm_eps": config.normalization_layer_epsilon,
      "tie_word_embeddings": config.logits_via_embedding,
  }


def rope_to_hf(config: Config) -> dict[str, Any]:
  theta = float(config.rope_max_timescale)
  parameters: dict[str, Any] = {"rope_theta": theta, "rope_type": "default"}
  if config.llama3_rope_scaling:
    parameters.update(rope_type="llama3", **{theirs: getattr(config, ours) for ours, theirs in _LLAMA3_KEYS.items()})
  # transformers 4 reads rope_scaling and rope_theta; 5 reads rope_parameters
  # but lets rope_scaling override it, so an imported model's stale one must go.
  scaling = dict(parameters) if config.llama3_rope_scaling else None
  return {"rope_parameters": parameters, "rope_scaling": scaling, "rope_theta": theta}
