"""The canonical parameter tree: flat paths, layer stacking, and checked loading.

Both backends declare the same nested dict of arrays (see DESIGN.md). This
module is the one place that knows how scanned layers (`decoder/layers`,
stacked on `param_scan_axis`) relate to unscanned ones (`decoder/layers_i`).
"""

import hashlib
import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.core import families
from maxbridge.core.pipeline_plan import pipeline_plan

# Layer stacks by name, as each family names them (MaxText's names): "layers",
# and DeepSeek's two, "dense_layers" then "moe_layers".
STACK_NAMES = families.STACK_NAMES
STACK_PATTERN = "|".join(STACK_NAMES)
_LAYER = re.compile(rf"^(.*/)?({STACK_PATTERN})_(\d+)(/.*)$")  # .../layers_3/x
_STACKED = re.compile(rf"^(.*/)?({STACK_PATTERN})(/.*)$")  # .../layers/x


def layer_stacks(config) -> tuple[tuple[str, int], ...]:
  """(stack name, number of layers) of the decoder's stacks, in depth order (the family's `stacks`)."""
  return config.family.layer_stacks(config)


def layer_axis(config, stack: str) -> str:
  """The logical axis of scanned stack `stack`'s layer dimension.

  "layers", split over the "stage" mesh axis, so each device holds its own
  stage's layers; "layers_outside_pipeline" (replicated over the stages) for a
  stack the pipeline does not run whole (DeepSeek's dense layers).
  """
  plan = pipeline_plan(config)
  if plan is None or (stack == plan.stack and plan.layers == dict(layer_stacks(config))[stack]):
    return "layers"
  return "layers_outside_pipeline"


def layer_of(path: str) -> tuple[str, int] | None:
  """`.../layers_3/x` -> (`.../layers/x`, 3); None for a path outside unscanned layers."""
  match = _LAYER.match(path)
  if not match:
    return None
  head, name, index, tail = match.groups()
  return f"{head or ''}{name}{tail}", int(index)


def is_stacked(path: str) -> bool:
  """True for a path inside scanned layers (`.../layers/x`)."""
  return bool(_STACKED.match(path))


def stack_name(path: str) -> str | None:
  """The layer stack a path belongs to ("layers", "moe_layers", ...), scanned or not."""
  match = _LAYER.match(path) or _STACKED.match(path)
  return match.group(2) if match else None


def layer_path(stacked: str, index: int) -> str:
  """(`.../layers/x`, 3) -> `.../layers_3/x`."""
  head, name, tail = _STACKED.match(stacked).groups()
  return f"{head or ''}{name}_{index}{tail}"


def sublayer_path(sub: str, under: str, suffixed: bool) -> str:
  """The path of `under` (`self_attention/query/kernel`) in a block's sub-layer `sub`, relative to the block.

  Nested: `local/self_attention/query/kernel`. Suffixed (MaxText's Gemma 2):
  the sub-layer's name ends the block's first module name,
  `self_attention_local/query/kernel`.
  """
  if not suffixed:
    return f"{sub}/{under}"
  module, _, rest = under.partition("/")
  return f"{module}_{sub}/{rest}" if rest else f"{module}_{sub}"


def layer_paths(config, under: str = "") -> list[str]:
  """Unscanned canonical path of every decoder layer, in depth order (`decoder/layers_0`, ...);
  with `under`, the path of `under` in each (`decoder/layers_0/self_attention/query/kernel`).

  A stack of blocks (a `Stack` with `sublayers`) gives one path per sub-layer
  (`decoder/layers_0/local`). A suffixed sub-layer (Gemma 2's) has no path of its
  own, only its modules do: name one in `under`.
  """
  paths = []
  for stack in config.family.stacks:
    if stack.suffixed and not under:
      raise ValueError(
          f"stack {stack.name!r} suffixes its sub-layers' module names ({stack.sublayers}): "
          "a sub-layer has no path of its own; pass `under` (a module path under the layer)"
      )
    for i in range(stack.depth(config)):
      layer = f"decoder/{stack.name}_{i}"
      if not stack.sublayers:
        paths.append(f"{layer}/{under}" if under else layer)
      for sub in stack.sublayers:
        paths.append(f"{layer}/{sublayer_path(sub, under, stack.suffixed)}" if under else f"{layer}/{sub}")
  return paths


def stack_layer_values(per_layer: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """Per-layer values, one dict per layer in depth order -> each stacked on a leading layer axis.

  The unscanned form of what a scanned stack returns (lax.scan stacks on axis 0).
  """
  keys = per_layer[0] if per_layer else {}
  return {key: jnp.stack([values[key] for values in per_layer]) for key in keys}


def concat_layer_stacks(per_stack: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
  """One dict of [layers, ...] values per stack, in depth order -> one [all layers, ...] value per key.

  A key that only some stacks return (DeepSeek's dense layers have no MoE loss)
  covers the layers of those stacks.
  """
  keys = dict.fromkeys(key for values in per_stack for key in values)
  return {key: jnp.concatenate([values[key] for values in per_stack if key in values]) for key in keys}


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """Nested dict -> {"a/b/c": leaf}. Non-dict values are leaves."""
  flat = {}
  for key, value in tree.items():
    path = f"{prefix}{key}"
    if isinstance(value, Mapping):
      flat.update(flatten(value, path + "/"))
    else:
      flat[path] = value
  return flat


def unflatten(flat: Mapping[str, Any]) -> dict[str, Any]:
  tree: dict[str, Any] = {}
  for path, value in flat.items():
    *parents, leaf = path.split("/")
    node = tree
    for name in parents:
      node = node.setdefault(name, {})
    node[leaf] = value
  return tree


def is_scanned(tree: Mapping[str, Any]) -> bool:
  return any(map(is_stacked, flatten(tree)))


def stack_layers(tree: Mapping[str, Any], axis: int) -> dict[str, Any]:
  """`layers_0 … layers_{L-1}` -> `layers` (and likewise each stack), leaves stacked on `axis`."""
  groups: dict[str, dict[int, Any]] = {}
  flat = {}
  for path, leaf in flatten(tree).items():
    if found := layer_of(path):
      groups.setdefault(found[0], {})[found[1]] = leaf
    else:
      flat[path] = leaf
  for path, by_index in groups.items():
    if sorted(by_index) != list(range(len(by_index))):
      raise ValueError(f"cannot stack {path}: layer indices {sorted(by_index)} are not 0..L-1")
    flat[path] = _stack([by_index[i] for i in range(len(by_index))], axis)
  return unflatten(flat)


def unstack_layers(tree: Mapping[str, Any], axis: int) -> dict[str, Any]:
  """`layers` stacked on `axis` -> `layers_0 … layers_{L-1}`."""
  flat = {}
  for path, leaf in flatten(tree).items():
    if not is_stacked(path):
      flat[path] = leaf
      continue
    for i in range(leaf.shape[axis]):
      flat[layer_path(path, i)] = _take(leaf, i, axis)
  return unflatten(flat)


def _stack(leaves: list, axis: int):
  if isinstance(leaves[0], jax.ShapeDtypeStruct):
    shape = list(leaves[0].shape)
    shape.insert(axis, len(leaves))
    return jax.ShapeDtypeStruct(tuple(shape), leaves[0].dtype)
  if isinstance(leaves[0], np.ndarray):
    return np.stack(leaves, axis=axis)
  return jnp.stack(leaves, axis=axis)


def _take(leaf, index: int, axis: int):
  if isinstance(leaf, jax.ShapeDtypeStruct):
    shape = list(leaf.shape)
    del shape[axis]
    return jax.ShapeDtypeStruct(tuple(shape), leaf.dtype)
  return leaf[(slice(None),) * axis + (index,)]


def conform(tree: Mapping[str, Any], abstract: Mapping[str, Any], axis: int) -> dict[str, Any]:
  """Returns `tree` in the scanned/unscanned form of `abstract`, checked leaf by leaf.

  A missing, extra or mis-shaped leaf raises ValueError naming its path.
  """
  got, want = _checked(tree, abstract, axis)
  return unflatten({p: jnp.asarray(got[p], want[p].dtype) for p in want})


def check(tree: Mapping[str, Any], abstract: Mapping[str, Any], axis: int) -> None:
  """`conform`'s checks alone: leaves need only a shape (arrays, or `jax.ShapeDtypeStruct`s).

  Checked on shapes: a tree stored unscanned for a scanned model is not stacked
  (a copy of every layer) just to be checked.
  """
  _checked(
      # Only shapes are compared; a leaf without a dtype (a Python number) still has one here.
      jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), getattr(x, "dtype", np.float32)), tree),
      abstract,
      axis,
  )


# Trees saved before each MTP module had its own final norm: the module applied decoder_norm.
_MTP_HEAD_NORM = re.compile(r"(.*)mtp/mtp_layer_\d+/head_norm/scale$")


def older_mtp_norms(missing: Sequence[str], present: Sequence[str] | Mapping[str, Any]) -> dict[str, str]:
  """{missing path: the path to copy it from} when every missing path is an MTP module's `head_norm`, which a
  tree saved before those norms existed lacks (it started as, and was, `decoder_norm`); else {}.

  Copying decoder_norm (and, in a train state, its optimizer state) keeps what the module computed.
  """
  sources = {}
  for path in missing:
    match = _MTP_HEAD_NORM.match(path)
    if match is None or f"{match.group(1)}decoder_norm/scale" not in present:
      return {}
    sources[path] = f"{match.group(1)}decoder_norm/scale"
  return sources


def _checked(tree: Mapping[str, Any], abstract: Mapping[str, Any], axis: int) -> tuple[dict, dict]:
  if not isinstance(tree, Mapping):
    raise TypeError(f"parameters must be a nested dict of arrays, got {type(tree).__name__}")
  want_scanned, have_scanned = is_scanned(abstract), is_scanned(tree)
  if want_scanned and not have_scanned:
    tree = stack_layers(tree, axis)
  elif have_scanned and not want_scanned:
    tree = unstack_layers(tree, axis)
  got, want = flatten(tree), flatten(abstract)
  missing = sorted(set(want) - set(got))
  got.update({path: got[source] for path, source in older_mtp_norms(missing, got).items()})
  missing = sorted(set(want) - set(got))
  extra = sorted(set(got) - set(want))
  if missing or extra:
    lines = [f"  missing: {p} {tuple(want[p].shape)}" for p in missing]
    lines += [f"  unexpected: {p}" for p in extra]
    raise ValueError("parameter tree does not match the model:\n" + "\n".join(lines))
  for path, leaf in got.items():
    if tuple(np.shape(leaf)) != tuple(want[path].shape):
      raise ValueError(f"parameter {path} has shape {tuple(np.shape(leaf))}, the model expects {tuple(want[path].shape)}")
  return got, want


def fingerprint(params: Mapping[str, Any], param_scan_axis: int) -> str:
  """A digest of the parameter values, path by path, the same whether the layers are scanned or not."""
  host = jax.device_get(params)
  digest = hashlib.sha256()
  for path, leaf in sorted(flatten(unstack_layers(host, param_scan_axis)).items()):
    array = np.ascontiguousarray(leaf)
    digest.update(f"{path}:{array.dtype}:{array.shape}\n".encode())
    digest.update(array.tobytes())
  return digest.hexdigest()[:24]
