"""Checkpoint layouts, and the one mapping between their paths.

Every layout is read into one *normal form*, the flat paths of MaxText's Linen
layout (this project's own checkpoints), and written from it:

    params/params/<T>                      T: a canonical parameter path
    opt_state/<i>/mu/params/<T>            (and nu; any optimizer leaf shaped like a parameter)
    opt_state/<i>/count
    step                                   int32

The optimizer state is whatever tree the optimizer keeps (AdamW's chain above;
Muon's `opt_state/inner_states/adam/inner_state/0/mu/params/<T>`, a partition
of chains): any path below `opt_state/` is kept as it is, save that a leaf
shaped like a parameter gets Linen's `params` level above `<T>`. A numbered
level (a tuple: Linen keeps it as a list, NNX as a dict of ints) is a level of
all-digit keys. Readers that need only the parameters never look below
`opt_state/` (`normal_paths(..., params_only=True)`).

The layouts this module reads and writes:

    linen   {"params": {"params": T}, "opt_state": [adam, None, schedule], "step": int32}
            MaxText's (and ours). MaxText's NNX path adds "nnx_aux" (RNG state),
            which is ignored. Linen variables ({"params": T}) are read too.
    nnx     nnx.to_pure_dict(nnx.state(TrainStateNNX)):
            {"model": T, "optimizer": {"opt_state": {0: adam, 2: schedule}, "step": uint32}}
            Older MaxText NNX checkpoints wrap every leaf as {"value": array} and
            key unscanned layers as layers/<i>/ instead of layers_<i>/.
    params only: either of the above without optimizer and step (MaxText's
            decode checkpoints), or a bare canonical tree T ("canonical").

Scanned layers are `.../layers/...`, stacked on param_scan_axis; unscanned are
`.../layers_<i>/...` (`maxbridge.canonical` knows which is which). Converters
and the comparator see normal paths only; the trainers map their states to the
linen layout here too (`optax_to_tree`, `nnx_to_linen`, `linen_to_nnx`), so a checkpoint
is the same tree whichever backend wrote it.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from typing import Any

import jax
import numpy as np

from maxbridge.core import canonical

# Subtrees a loader may ignore: MaxText's NNX path saves its RNG state here; a DiLoCo run
# (maxbridge.training.diloco) its replicas' states, beside the global model in "params".
IGNORED = ("nnx_aux", "diloco")
LINEN, NNX, CANONICAL = "linen", "nnx", "canonical"
_PARAM_ROOTS = {"token_embedder", "decoder"}
STEP_DTYPES = {LINEN: np.dtype(np.int32), NNX: np.dtype(np.uint32)}
# Older MaxText NNX checkpoints key unscanned layers as layers/<i>/.
_INTEGER_LAYER = re.compile(rf"(^|/)({canonical.STACK_PATTERN})/(\d+)(?=/|$)")


class LayoutError(ValueError):
  """A tree that is not in any layout this module knows; the message names the path."""


@dataclasses.dataclass(frozen=True)
class Layout:
  """What `detect` found: the layout of a checkpoint or tree, and its variants."""

  kind: str  # "linen" | "nnx" | "canonical"
  params_only: bool
  scanned: bool
  dtype: str  # of the parameters; "mixed" when they differ
  value_wrappers: bool = False  # {"value": array} leaves (older MaxText NNX)
  integer_layer_keys: bool = False  # layers/<i>/ (older MaxText NNX, unscanned)
  single_params_level: bool = False  # {"params": T} (Linen variables), not {"params": {"params": T}}
  ignored: tuple[str, ...] = ()

  @property
  def is_normal(self) -> bool:
    """True when stored paths are already normal paths (our own checkpoints)."""
    return self.kind == LINEN and not (self.value_wrappers or self.integer_layer_keys or self.single_params_level)

  def describe(self) -> str:
    name = {
        LINEN: "linen layout (MaxText)",
        NNX: "nnx layout (pure dict of TrainStateNNX)",
        CANONICAL: "canonical parameter tree",
    }[self.kind]
    variants = [
        text
        for flag, text in (
            (self.value_wrappers, "{'value': ...} leaf wrappers"),
            (self.integer_layer_keys, "integer layer keys"),
            (self.single_params_level, "one 'params' level"),
        )
        if flag
    ]
    if variants:
      name += f" with {', '.join(variants)}"
    parts = [name, "scanned" if self.scanned else "unscanned", self.dtype]
    parts.append("params only" if self.params_only else "with optimizer state")
    if self.ignored:
      parts.append(f"ignoring {', '.join(self.ignored)}")
    return ", ".join(parts)


# --- flat paths of any tree ---------------------------------------------------


def flatten_tree(tree: Any, prefix: str = "") -> dict[str, Any]:
  """Nested dicts and lists -> {"a/0/b": leaf}. Keys become strings; None entries are dropped."""
  if isinstance(tree, Mapping):
    items = tree.items()
  elif isinstance(tree, (list, tuple)):
    items = enumerate(tree)
  elif tree is None:
    return {}
  else:
    return {prefix.rstrip("/"): tree}
  flat = {}
  for key, value in items:
    flat.update(flatten_tree(value, f"{prefix}{key}/"))
  return flat


def keypath_str(keypath) -> str:
  """A jax key path -> the "a/0/b" form `flatten_tree` gives."""
  return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in keypath)


# --- detection ----------------------------------------------------------------


def detect(tree_or_flat: Any) -> Layout:
  """The layout of a nested tree or its `flatten_tree` form (arrays or abstract leaves)."""
  flat = flatten_tree(tree_or_flat)  # a no-op on a flat dict
  if not flat:
    raise LayoutError("the tree is empty: no arrays to read")
  tops = {p.split("/")[0] for p in flat}
  ignored = tuple(sorted(tops & set(IGNORED)))
  tops -= set(IGNORED)
  if "model" in tops:
    kind, params_root, known = NNX, "model", {"model", "optimizer"}
  elif "params" in tops:
    kind, params_root, known = LINEN, "params", {"params", "opt_state", "step"}
  elif tops and tops <= _PARAM_ROOTS:
    kind, params_root, known = CANONICAL, None, _PARAM_ROOTS
  else:
    raise LayoutError(
        f"top-level keys {sorted(tops)} are not a checkpoint layout this tool knows: expected "
        "params/opt_state/step (Linen, MaxText), model/optimizer (NNX) or token_embedder/decoder "
        "(a canonical parameter tree)"
    )
  if tops - known:
    raise LayoutError(
        f"unexpected top-level key(s) {sorted(tops - known)} in a {kind} tree; "
        f"expected {sorted(known)} (and {list(IGNORED)}, which is ignored)"
    )
  param_paths = [p for p in flat if params_root is None or p.split("/")[0] == params_root]
  wrapped = all(p.endswith("/value") for p in flat if p.split("/")[0] not in IGNORED)
  # Linen variables ({"params": T}): parameter roots right under "params" (a LoRA checkpoint's
  # {"params": {"lora": adapters}} is ours, not this).
  single = kind == LINEN and all(p.split("/")[1] in _PARAM_ROOTS for p in param_paths)
  params = [_param_path(p, params_root, wrapped, single) for p in param_paths]
  dtypes = {str(np.dtype(flat[p].dtype)) for p in param_paths if hasattr(flat[p], "dtype")}
  return Layout(
      kind=kind,
      params_only=not (tops - {params_root} - _PARAM_ROOTS),
      scanned=any(map(canonical.is_stacked, params)),
      dtype=dtypes.pop() if len(dtypes) == 1 else "mixed",
      value_wrappers=wrapped,
      integer_layer_keys=any(_INTEGER_LAYER.search(p) for p in param_paths),
      single_params_level=single,
      ignored=ignored,
  )


def _param_path(path: str, root: str | None, wrapped: bool, single: bool) -> str:
  """A stored parameter path -> its canonical path T."""
  parts = path.split("/")
  if root is not None:
    parts = parts[1:] if single or root == "model" else parts[2:]
  return _fix_leaf("/".join(parts), wrapped)


def _fix_leaf(path: str, wrapped: bool) -> str:
  # Older NNX checkpoints: {"value": array} leaves, and layers/<i>/ for layers_<i>/.
  if wrapped and path.endswith("/value"):
    path = path[: -len("/value")]
  return _INTEGER_LAYER.sub(r"\1\2_\3", path)


# --- stored paths <-> normal paths ----------------------------------------------


def normal_paths(flat: Mapping[str, Any], layout: Layout, *, params_only: bool = False) -> dict[str, str]:
  """{stored path: normal path} for every leaf of `flat` (ignored subtrees left out).

  params_only: the parameters alone; the optimizer state and step are left out unread, so a reader of
  parameters works whatever the optimizer kept.
  """
  root = {NNX: "model", LINEN: "params", CANONICAL: None}[layout.kind]
  mapping, params = {}, set()
  for path in flat:
    top = path.split("/")[0]
    if top in layout.ignored:
      continue
    if root is None or top == root:
      param = _param_path(path, root, layout.value_wrappers, layout.single_params_level)
      mapping[path] = f"params/params/{param}"
      params.add(param)
  if params_only:
    return mapping
  for path in flat:
    if path in mapping or path.split("/")[0] in layout.ignored:
      continue
    mapping[path] = _optimizer_path(path, layout, params)
  return mapping


def _optimizer_path(path: str, layout: Layout, params: set[str]) -> str:
  stripped = _fix_leaf(path, layout.value_wrappers)
  parts = stripped.split("/")
  if layout.kind == NNX and parts[0] == "optimizer":
    parts = parts[1:]
  if parts == ["step"]:
    return "step"
  if parts[0] != "opt_state":
    expected = "optimizer/opt_state/..., optimizer/step" if layout.kind == NNX else "opt_state/..., step"
    raise LayoutError(f"unexpected path {path} in a {layout.kind} checkpoint; expected {expected}")
  rest = parts[1:]
  # The optimizer's own structure (a chain's indices, a partition's labels, its fields) is kept as it is: only a
  # leaf shaped like a parameter is recognised, by ending in a parameter's path.
  for split in range(len(rest)):
    if "/".join(rest[split:]) in params:
      # Linen keeps a {"params": ...} collection level above the tree (its optimizer sees the variables), NNX
      # does not (its optimizer sees the model's State).
      head = rest[:split]
      if head and head[-1] == "params":
        head = head[:-1]
      return "/".join(["opt_state", *head, "params", *rest[split:]])
  return "/".join(["opt_state", *rest])


def layout_path(normal: str, kind: str) -> str:
  """A normal path as `kind` ("linen" or "nnx") stores it."""
  if kind == LINEN:
    return normal
  if kind != NNX:
    raise ValueError(f"cannot write layout {kind!r}; expected 'linen' or 'nnx'")
  parts = normal.split("/")
  if parts[:2] == ["params", "params"]:
    return "/".join(["model", *parts[2:]])
  if parts == ["step"]:
    return "optimizer/step"
  if parts[0] == "opt_state":
    return "/".join(["optimizer", *[p for i, p in enumerate(parts) if not _is_params_level(parts, i)]])
  raise LayoutError(f"{normal} is not a normal path")


def _is_params_level(parts: list[str], i: int) -> bool:
  # The Linen {"params": ...} level of an optimizer leaf shaped like a parameter: the first "params" below
  # opt_state/ (`_optimizer_path` puts one there, and only there).
  return parts[i] == "params" and i >= 1 and "params" not in parts[1:i]


def layout_dtype(normal: str, dtype: Any, kind: str) -> np.dtype:
  """The dtype `kind` stores a normal leaf in: the step is int32 in Linen, uint32 in NNX."""
  return STEP_DTYPES[kind] if normal == "step" else np.dtype(dtype)


def build_tree(normal_flat: Mapping[str, Any], kind: str) -> dict:
  """Normal leaves -> the nested tree `kind` stores (leaves as given; see `layout_dtype`).

  A numbered level of the optimizer state (a chain's tuple) is a list in Linen, with None for empty states;
  in NNX a dict keyed by the int index of each non-empty state, as `nnx.to_pure_dict` gives it.
  """
  tree: dict = {}
  for normal, leaf in normal_flat.items():
    *parents, name = layout_path(normal, kind).split("/")
    node = tree
    for parent in parents:
      node = node.setdefault(parent, {})
    node[name] = leaf
  if kind == LINEN and "opt_state" in tree:
    tree["opt_state"] = _numbered(tree["opt_state"], _as_list)
  if kind == NNX and "opt_state" in tree.get("optimizer", {}):
    tree["optimizer"]["opt_state"] = _numbered(tree["optimizer"]["opt_state"], _int_keys)
  return tree


def _as_list(node: dict) -> list:
  return [node.get(str(i)) for i in range(max(map(int, node)) + 1)]


def _int_keys(node: dict) -> dict:
  return {int(k): v for k, v in node.items()}


def _numbered(node: Any, numbered) -> Any:
  """`node` with each level of all-digit keys made `numbered(level)`; a parameter tree below a Linen "params"
  level is left as it is (its keys are a model's, not an optimizer's)."""
  if not isinstance(node, dict):
    return node
  node = {k: v if k == "params" else _numbered(v, numbered) for k, v in node.items()}
  return numbered(node) if node and all(k.isdigit() for k in node) else node


def normalize(tree: Any, layout: Layout | None = None) -> dict:
  """A tree in any layout -> the Linen tree of its normal paths (leaves untouched, ignored subtrees dropped)."""
  flat = flatten_tree(tree)
  layout = layout or detect(flat)
  return build_tree({n: flat[s] for s, n in normal_paths(flat, layout).items()}, LINEN)


def stored_like(stored: Mapping[str, Any], layout: Layout, normal_tree: Any) -> dict:
  """`normal_tree`'s leaves arranged as `stored` (a tree in `layout`) holds them.

  For restoring a checkpoint in another layout into a normal target: the
  target goes to disk in the checkpoint's own structure. Ignored subtrees are
  left out, as are stored leaves the target lacks.
  """
  wanted = flatten_tree(normal_tree)
  mapping = normal_paths(flatten_tree(stored), layout)
  kept = {k: v for k, v in stored.items() if k not in layout.ignored}

  def leaf(keypath, _):
    return wanted.get(mapping.get(keypath_str(keypath)))

  return jax.tree_util.tree_map_with_path(leaf, kept)


def cast_floating(tree: Any, dtype: Any) -> Any:
  """`tree` (dicts, lists, None) with its floating-point leaves cast to `dtype`; integers (steps, counts) kept."""
  dtype = np.dtype(dtype)

  def cast(leaf):
    return leaf.astype(dtype) if np.issubdtype(np.dtype(leaf.dtype), np.floating) else leaf

  return jax.tree.map(cast, tree)


# --- train states in memory -> the linen layout, and back ------------------------


def optax_to_tree(node: Any) -> Any:
  """An optax state in the linen layout: tuples become lists, NamedTuples dicts of their fields, empty states None."""
  if hasattr(node, "_fields"):
    return {f: optax_to_tree(getattr(node, f)) for f in node._fields} if node._fields else None
  if isinstance(node, (tuple, list)):
    return [optax_to_tree(x) for x in node]
  if isinstance(node, Mapping):
    return {k: optax_to_tree(v) for k, v in node.items()}
  return node


def optax_from_tree(template: Any, tree: Any) -> Any:
  """The inverse of `optax_to_tree`, rebuilding `template`'s optax types."""
  if hasattr(template, "_fields"):
    if not template._fields:
      return template
    return type(template)(*(optax_from_tree(getattr(template, f), tree[f]) for f in template._fields))
  if isinstance(template, (tuple, list)):
    return type(template)(optax_from_tree(t, x) for t, x in zip(template, tree))
  if isinstance(template, Mapping):
    return {k: optax_from_tree(template[k], tree[k]) for k in template}
  return tree


def _flat_leaves(tree: Any) -> dict[str, Any]:
  # jax's flattening, not flatten_tree: a PartitionSpec (a tuple) is a leaf here.
  return {keypath_str(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def linen_to_nnx(tree: Any) -> dict:
  """A tree in the linen layout -> the nnx layout's pure dict; leaves as given (see `layout_dtype`)."""
  return build_tree(_flat_leaves(tree), NNX)


def nnx_to_linen(tree: Any, like: Any) -> Any:
  """An nnx-layout pure dict (arrays, shardings or specs) -> the linen-layout tree `like` describes.

  `like` (the abstract linen tree) says where Linen keeps the None of an empty
  optimizer state, which the nnx layout omits.
  """
  flat = _flat_leaves(tree)
  return jax.tree_util.tree_map_with_path(lambda path, _: flat[layout_path(keypath_str(path), NNX)], like)
