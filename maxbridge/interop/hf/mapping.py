"""The one loop each way between Hugging Face tensors and the canonical tree, and configs."""

from __future__ import annotations

import re
import warnings
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from absl import logging

from maxbridge.core import canonical
from maxbridge.core.config import BASE_CONFIG, Config, load_config
from maxbridge.interop.hf.families import HFError, Part, Piece, Rule, family_for_config, family_for_model_type

# --- configs -----------------------------------------------------------------------------


def config_from_hf(hf_config: Mapping[str, Any], *overrides: str, **kwargs: Any) -> Config:
  """A Config for a Hugging Face config.json (a dict); `overrides`/`kwargs` as in load_config."""
  if not isinstance(hf_config, Mapping):
    raise HFError(f"config.json must hold a JSON object, got a {type(hf_config).__name__}")
  family = family_for_model_type(hf_config.get("model_type"))
  values = family.config_from_hf(hf_config)
  values["model_name"] = str(hf_config.get("_name_or_path") or family.model_type)
  values["normalize_embedding_logits"] = family.normalize_embedding_logits
  # An override names a key on purpose: it wins over the one read from config.json.
  given = {text.partition("=")[0].strip() for text in overrides}
  values = {key: value for key, value in values.items() if key not in given}
  # Keys a Hugging Face config does not set keep base.yml's defaults.
  return load_config(str(BASE_CONFIG), *overrides, **{**values, **kwargs})


def config_to_hf(config: Config, base: Mapping[str, Any] | None = None) -> dict[str, Any]:
  """config.json for `cfg`; keys of `base` (an imported model's original config) are kept."""
  family = family_for_config(config)
  if config.logits_via_embedding and config.normalize_embedding_logits != family.normalize_embedding_logits:
    raise HFError(
        f"normalize_embedding_logits={config.normalize_embedding_logits} with a tied head has no Hugging Face "
        f"{family.model_type} equivalent, which computes it as normalize_embedding_logits="
        f"{family.normalize_embedding_logits}"
    )
  hf = dict(base or {})
  if hf.get("model_type") != family.model_type and isinstance(hf.get("text_config"), Mapping):
    # A multimodal folder's language model exported as its text architecture (Qwen3.5's): the text config's keys
    # are what is kept; the outer ones (text_config itself, vision_config) would not load as a text model.
    hf = dict(hf["text_config"])
  hf.pop("torch_dtype", None)
  for alias in family.config_class.aliases:  # transformers would read an alias in place of what we write
    hf.pop(alias, None)
  hf.update(family.config_to_hf(config))
  if family.model_type != "gpt2":  # GPT-2's is n_positions, a model size
    # Not a model size here (max_target_length is a training length): kept from
    # an imported model's config, else the longest sequence this config trains on.
    hf.setdefault("max_position_embeddings", config.max_target_length)
  hf.update(
      model_type=family.model_type,
      architectures=[family.architecture],
      dtype=jnp.dtype(config.weight_dtype).name,
  )
  return hf


# --- tensors -----------------------------------------------------------------------------

# The output projection and the token embedding, in the canonical tree.
_HEAD, _EMBEDDING = "decoder/logits_dense/kernel", "token_embedder/embedding"


def _tied_pair(config: Config) -> tuple[str, str]:
  """(Hugging Face name of the output projection, of the token embedding) in `cfg`'s family."""
  names = {rule.ours: rule.hf for rule in family_for_config(config).rules}
  return names[_HEAD], names[_EMBEDDING]


def _stored_head_differs(config: Config, tensors: Mapping[str, Any]) -> bool:
  """Whether a tied `cfg`'s folder also holds an output projection with other values than its embedding."""
  family = family_for_config(config)
  tensors = {family.normalize_name(name): tensor for name, tensor in tensors.items()}
  head, embedding = _tied_pair(config)
  if not config.logits_via_embedding or head not in tensors or embedding not in tensors:
    return False
  head_value, embedding_value = _load(tensors[head]), _load(tensors[embedding])
  return head_value.shape != embedding_value.shape or not bool(jnp.array_equal(head_value, embedding_value))


def untie_a_stored_head(config: Config, tensors: Mapping[str, Any]) -> Config:
  """`cfg` as transformers 5.x reads tie_word_embeddings=true beside a stored lm_head.weight.

  It ties the two only where their values are equal; where they differ it
  warns, leaves them untied and computes logits with the stored lm_head.weight.
  """
  if not _stored_head_differs(config, tensors):
    return config
  head, embedding = _tied_pair(config)
  warnings.warn(
      f"config.json says tie_word_embeddings=true, but {head} differs from {embedding}: read untied, "
      "as transformers does (logits from the stored output projection)",
      stacklevel=2,
  )
  return config.replace(logits_via_embedding=False)


def _expansions(rule: Rule, config: Config) -> list[tuple[int | None, str]]:
  """(Hugging Face layer index, canonical path) pairs a rule can produce: MTP module k is layer
  num_decoder_layers + k - 1, its decoder layer under `layer/` (see `HFFamily.mtp_copies`)."""
  if rule.ours.startswith("{mtp}/"):
    return _mtp_layers(config, rule.ours.removeprefix("{mtp}/"))
  if "{vision_layer}" in rule.ours:  # a vision tower's blocks, unscanned (`vision_encoder/encoderblock_<i>`)
    count = config.num_hidden_layers_for_vit if config.use_multimodal else 0
    return [(i, rule.ours.replace("{vision_layer}", str(i))) for i in range(count)]
  if "{layer}" not in rule.ours:
    return [(None, rule.ours)]
  under = rule.ours.removeprefix("{layer}/")
  if "{layer}" in under:
    raise ValueError(f"rule {rule.hf} -> {rule.ours}: a canonical template must start with '{{layer}}/'")
  return list(enumerate(canonical.layer_paths(config, under))) + _mtp_layers(config, f"layer/{under}")


def _mtp_layers(config: Config, under: str) -> list[tuple[int, str]]:
  first = config.num_decoder_layers
  return [(first + k - 1, f"decoder/mtp/mtp_layer_{k}/{under}") for k in range(1, config.mtp_num_layers + 1)]


def _mtp_names(config: Config, layer: int) -> list[str]:
  """The Hugging Face names of one MTP layer's own tensors (not its decoder layer's) in `cfg`'s family."""
  return [rule.hf.format(layer=layer) for rule in family_for_config(config).rules if rule.ours.startswith("{mtp}/")]


def stored_mtp_layers(config: Config, tensors: Mapping[str, Any]) -> int:
  """How many MTP modules a folder's tensors hold after `cfg`'s decoder layers (0 for a family that stores none)."""
  family = family_for_config(config)
  names = {family.normalize_name(name) for name in tensors}
  count = 0
  while (own := _mtp_names(config, config.num_decoder_layers + count)) and names.issuperset(own):
    count += 1
  return count


def _mtp_copies(config: Config) -> dict[str, str]:
  """{an MTP layer's copy: the model's own tensor it holds}, both Hugging Face names, for `cfg`'s MTP layers."""
  family = family_for_config(config)
  names = {rule.ours: rule.hf for rule in family.rules}
  copies = {}
  for k in range(1, config.mtp_num_layers + 1):
    for copy, ours in family.mtp_copies.items():
      if ours == _HEAD and config.logits_via_embedding:
        ours = _EMBEDDING  # a tied head: the embedding projects
      copies[copy.format(layer=config.num_decoder_layers + k - 1)] = names[ours]
  return copies


def to_hf_tensors(params: Mapping[str, Any], config: Config) -> dict[str, Any]:
  """Canonical tree (scanned or not) -> {Hugging Face name: array}."""
  flat = canonical.flatten(_unscanned(params, config))
  family = family_for_config(config)
  tensors: dict[str, Any] = {}
  parts: dict[str, dict[int, tuple[Part, Any]]] = {}  # tensors that several rules' `Part`s make up
  used = set()

  def put(name: str, transform, value) -> None:
    if isinstance(transform, Part):
      parts.setdefault(name, {})[transform.index] = (transform, transform.to_hf(value, config))
    else:
      tensors[name] = transform.to_hf(value, config)

  for rule in family.rules:
    for layer, path in _expansions(rule, config):
      if path not in flat:
        continue
      used.add(path)
      value = flat[path]
      if "{expert}" in rule.hf:
        for expert in range(value.shape[0]):
          put(rule.hf.format(layer=layer, expert=expert), rule.transform, value[expert])
      else:
        put(rule.hf.format(layer=layer), rule.transform, value)
  unmapped = sorted(set(flat) - used)
  if unmapped:
    raise HFError(f"no Hugging Face name for canonical parameters: {unmapped}")
  for name, pieces in parts.items():
    part = next(iter(pieces.values()))[0]
    if sorted(pieces) != list(range(part.count)):
      raise HFError(f"{name}: the canonical tree holds parts {sorted(pieces)} of its {part.count}")
    tensors[name] = jnp.concatenate([pieces[i][1] for i in range(part.count)], axis=part.axis)
  for copy, original in _mtp_copies(config).items():
    tensors[copy] = tensors[original]
  return tensors


def expected_hf_shapes(config: Config, abstract: Mapping[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
  """{Hugging Face name: shape} the model of `cfg` (abstract canonical tree) reads."""
  return jax.eval_shape(lambda p: to_hf_tensors(p, config), _unscanned(abstract, config))


def from_hf_tensors(
    tensors: Mapping[str, Any], config: Config, abstract: Mapping[str, Any], *, where: str = "folder"
) -> dict[str, Any]:
  """{Hugging Face name: array, or a lazy tensor from `open_hf_tensors`} -> unscanned canonical tree.

  Names and shapes are checked first: a tensor no rule claims, or one the
  model needs but `tensors` lacks, is an error naming it; values are computed
  in float32 and cast to the abstract tree's dtypes.
  """
  family = family_for_config(config)
  tensors = {family.normalize_name(name): tensor for name, tensor in tensors.items()}
  ignored = {name for name in tensors if any(re.fullmatch(pattern, name) for pattern in family.ignored)}
  if ignored:  # as transformers' class leaves them out; said, so that a user sees what the model does not hold
    logging.info(
        "%s: %d tensors %s does not read are left out (first: %s)", where, len(ignored), family.architecture, min(ignored)
    )
  tensors = {name: tensor for name, tensor in tensors.items() if name not in ignored}
  if family.mtp_copies:  # MTP layers past the config's are left out, as transformers leaves them all out
    tensors = {name: tensor for name, tensor in tensors.items() if not _beyond_mtp_layers(config, name)}
  if _stored_head_differs(config, tensors):
    head, embedding = _tied_pair(config)
    raise HFError(
        f"config.json says tie_word_embeddings=true, but {where} holds a {head} that differs from {embedding}; "
        "transformers then unties them: read the config with untie_a_stored_head first"
    )
  expected = expected_hf_shapes(config, abstract)
  given = set(tensors)
  tied_copy = {"lm_head.weight", _tied_pair(config)[0]} if config.logits_via_embedding else set()
  missing = sorted(set(expected) - given)
  unknown = sorted(given - set(expected) - tied_copy)
  if missing or unknown:
    lines = [f"  missing: {name} {tuple(expected[name].shape)}" for name in missing[:20]]
    lines += [f"  unknown: {name}" for name in unknown[:20]]
    more = len(missing) + len(unknown) - len(lines)
    lines += [f"  ... and {more} more"] if more > 0 else []
    raise HFError(
        f"the Hugging Face tensors in {where} do not match a {config.decoder_block} model of this "
        "config:\n" + "\n".join(lines)
    )
  shapes = {name: _shape(tensors[name]) for name in expected}
  misshaped = [
      f"  {name} has shape {shapes[name]}, expected {tuple(want.shape)}"
      for name, want in expected.items()
      if shapes[name] != tuple(want.shape)
  ]
  if misshaped:
    raise HFError(f"Hugging Face tensors in {where} have the wrong shapes:\n" + "\n".join(misshaped[:20]))
  for copy, original in _mtp_copies(config).items():
    if not bool(jnp.array_equal(_load(tensors[copy]), _load(tensors[original]))):
      raise HFError(
          f"{where}: {copy} differs from {original}, and maxbridge's MTP modules share the model's own "
          "embedding and output head; import with mtp_num_layers=0 to leave the MTP layers out"
      )

  want_flat = canonical.flatten(_unscanned(abstract, config))
  flat = {}
  pieces: dict[str, dict[int, tuple[int, Any]]] = {}  # canonical arrays that several rules' `Piece`s make up
  for rule in family.rules:
    for layer, path in _expansions(rule, config):
      if path not in want_flat:
        continue
      want = want_flat[path]
      if "{expert}" in rule.hf:
        value = jnp.stack(
            [
                rule.transform.to_ours(_load(tensors[rule.hf.format(layer=layer, expert=e)]), want.shape[1:], config)
                for e in range(want.shape[0])
            ]
        )
      else:
        value = rule.transform.to_ours(_load(tensors[rule.hf.format(layer=layer)]), want.shape, config)
      if isinstance(rule.transform, Piece):  # joined once every piece is read
        pieces.setdefault(path, {})[rule.transform.index] = (rule.transform.axis, value)
        continue
      flat[path] = value.astype(want.dtype)
  for path, parts in pieces.items():
    axis = parts[0][0]
    flat[path] = jnp.concatenate([parts[i][1] for i in sorted(parts)], axis=axis).astype(want_flat[path].dtype)
  return canonical.unflatten(flat)


def _beyond_mtp_layers(config: Config, name: str) -> bool:
  """Whether `name` is a tensor of a Hugging Face layer past the decoder's and the config's MTP layers."""
  prefix = next(rule.hf for rule in family_for_config(config).rules if rule.ours.startswith("{mtp}/")).split("{layer}")[0]
  match = re.match(re.escape(prefix) + r"(\d+)\.", name)
  return match is not None and int(match.group(1)) >= config.num_decoder_layers + config.mtp_num_layers


def _unscanned(tree: Mapping[str, Any], config: Config) -> dict[str, Any]:
  if canonical.is_scanned(tree):
    return canonical.unstack_layers(tree, config.param_scan_axis)
  return canonical.unflatten(canonical.flatten(tree))


class LazyTensor:
  """A tensor in a safetensors file, read when first needed."""

  def __init__(self, handle, name: str):
    self.handle, self.name = handle, name

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(self.handle.get_slice(self.name).get_shape())

  def __call__(self):
    return self.handle.get_tensor(self.name)


def _shape(tensor) -> tuple[int, ...]:
  return tuple(tensor.shape)


def _load(tensor):
  value = tensor() if isinstance(tensor, LazyTensor) else tensor
  return jnp.asarray(value, jnp.float32)
