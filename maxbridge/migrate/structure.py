"""Automatic matching, module by module: which Linen leaf is which NNX leaf where the user's rules say nothing.

The two trees name and order modules differently but hold the same arrays, so
the matching goes module by module:

1. leaves of the same name (and collection), then leaves left over that have a
   unique (collection, shape) within their module;
2. submodules of the same name; Linen's `layers_3` vs NNX `layers[3]`;
3. submodules left over, by structure and shape: a Linen submodule pairs with
   the one NNX submodule whose whole subtree matches it; several alike pair in
   order only where the order is known on both sides (Linen auto-names of one
   class, `Dense_0` < `Dense_1`, vs NNX definition order); otherwise the plan
   reports them as ambiguous rather than guess;
4. a stack (`nn.scan`/`nn.vmap`: every leaf carries a layer axis) vs an NNX
   list of modules: each leaf of element i is the stacked leaf at index i of
   the one axis that fits every leaf of the collection. `nnx.vmap`-stacked
   modules hold stacked leaves themselves and match as any module does.

`match_modules` runs it over the leaves the rules left; `match` makes the plan of its result.
"""

from __future__ import annotations

import contextvars
import dataclasses
import re
from collections.abc import Iterable
from typing import Any

from maxbridge.migrate.leaves import LinenLeaf, Link, NNXLeaf, path_str

_AUTO_NAME = re.compile(r"(?P<cls>[A-Za-z_][A-Za-z0-9_]*?)_(?P<index>\d+)")


def _definition_order(module: Any, path: tuple) -> dict:
  """Position of each child of the node at `path`, as the author assigned them (NNX state sorts them)."""
  node = module
  for key in path:
    try:
      node = node[key] if isinstance(key, int) else getattr(node, key)
    except (AttributeError, IndexError, KeyError, TypeError):
      return {}
  names = [k for k in vars(node) if not k.startswith("_")] if hasattr(node, "__dict__") else []
  return {name: i for i, name in enumerate(names)}


class _Node(dict):
  """Children by key; a leaf's key is (name, collection)."""

  def __init__(self, path: tuple):
    super().__init__()
    self.path = path


def _is_leaf(x) -> bool:
  return isinstance(x, (LinenLeaf, NNXLeaf))


def _linen_tree(leaves: Iterable[LinenLeaf]) -> _Node:
  root = _Node(())
  for leaf in leaves:
    node = root
    for name in leaf.path[1:-1]:
      node = node.setdefault(name, _Node(node.path + (name,)))
    node[(leaf.path[-1], leaf.collection)] = leaf
  return root


def _nnx_tree(leaves: Iterable[NNXLeaf], module: Any) -> _Node:
  root = _Node(())
  for leaf in leaves:
    node = root
    for name in leaf.path[:-1]:
      node = node.setdefault(name, _Node(node.path + (name,)))
    node[(leaf.path[-1], leaf.collection)] = leaf

  def reorder(node: _Node):
    order = _definition_order(module, node.path)

    def rank(k):
      name = k[0] if isinstance(k, tuple) else k
      # List indices in number order (layer 10 after layer 9); anything the author did not assign, last.
      return (order.get(name, len(order)), name if isinstance(name, int) else -1, str(k))

    keys = sorted(node, key=rank)
    items = [(k, node.pop(k)) for k in keys]
    node.update(items)
    for child in node.values():
      if isinstance(child, _Node):
        reorder(child)

  reorder(root)
  return root


def _is_sequence(node) -> bool:
  return isinstance(node, _Node) and bool(node) and all(isinstance(k, int) for k in node)


def _flat(node: _Node, prefix=()) -> dict:
  out = {}
  for key, child in node.items():
    if isinstance(child, _Node):
      out.update(_flat(child, prefix + (key,)))
    else:
      out[prefix + (key,)] = child
  return out


# ---------------------------------------------------------------- matching


@dataclasses.dataclass
class Result:
  links: list = dataclasses.field(default_factory=list)  # (LinenLeaf, NNXLeaf) pairs, or Links of a stack
  unmatched_linen: list = dataclasses.field(default_factory=list)
  unmatched_nnx: list = dataclasses.field(default_factory=list)
  ambiguous: list = dataclasses.field(default_factory=list)
  notes: list = dataclasses.field(default_factory=list)
  modules: list = dataclasses.field(default_factory=list)  # (linen module path, nnx module path)
  stacks: list = dataclasses.field(default_factory=list)  # (linen stack path, nnx list path, layers)

  @property
  def complete(self) -> bool:
    return not (self.unmatched_linen or self.unmatched_nnx or self.ambiguous)

  def extend(self, other: "Result") -> None:
    for field in dataclasses.fields(self):
      getattr(self, field.name).extend(getattr(other, field.name))


def _stack_axes(linen_shape: tuple, nnx_shape: tuple, layers: int) -> set[int]:
  return {
      a
      for a in range(len(linen_shape))
      if linen_shape[a] == layers and linen_shape[:a] + linen_shape[a + 1 :] == nnx_shape
  }


def _match_leaves(lin: _Node, nx: _Node, layers: int | None, res: Result) -> None:
  """Leaves of one module pair: by name, then by a unique (collection, shape). `layers`: matching a stack."""

  def fits(a: LinenLeaf, b: NNXLeaf) -> bool:
    if a.collection != b.collection:
      return False
    return bool(_stack_axes(a.shape, b.shape, layers)) if layers else a.shape == b.shape

  lin_left = {k: v for k, v in lin.items() if _is_leaf(v)}
  nnx_left = {k: v for k, v in nx.items() if _is_leaf(v)}
  for key in list(lin_left):
    if key in nnx_left:
      a, b = lin_left[key], nnx_left[key]
      if fits(a, b):
        res.links.append((a, b))
        del lin_left[key], nnx_left[key]
      else:
        res.notes.append(
            f"{path_str(a.path)} {a.shape} and {path_str(b.path)} {b.shape} share a name but not a shape"
            + (f" (stacked over {layers} layers)" if layers else "")
            + ": a rule with a transform (transpose, reshape) can map them"
        )
  # Left over: pair by (collection, shape) where that is unique on both sides.
  for a in list(lin_left.values()):
    cands = [b for b in nnx_left.values() if fits(a, b)]
    rivals = [x for x in lin_left.values() if cands and fits(x, cands[0])]
    if len(cands) == 1 and len(rivals) == 1:
      res.links.append((a, cands[0]))
      del lin_left[(a.path[-1], a.collection)]
      del nnx_left[(cands[0].path[-1], cands[0].collection)]
    elif len(cands) > 1 or len(rivals) > 1:
      res.ambiguous.append(
          (
              [path_str(x.path) for x in rivals],
              [path_str(x.path) for x in cands],
              "same collection and shape, different names",
          )
      )
      for x in rivals:
        lin_left.pop((x.path[-1], x.collection), None)
      for x in cands:
        nnx_left.pop((x.path[-1], x.collection), None)
  res.unmatched_linen.extend(lin_left.values())
  res.unmatched_nnx.extend(nnx_left.values())


def _children(node: _Node) -> dict:
  return {k: v for k, v in node.items() if isinstance(v, _Node)}


# Results of matching one pair of nodes, during one `match` call: trying every left-over pair for a fit and
# then matching the chosen one would otherwise redo whole subtrees at every level. A context variable, so that
# calls in other threads each keep their own.
_MEMO: contextvars.ContextVar[dict] = contextvars.ContextVar("maxbridge_migrate_memo")


def _match(lin: _Node, nx: _Node, layers: int | None = None) -> Result:
  """Matches one Linen module (or stack, `layers` set) with one NNX module. The result is shared: extend, never edit."""
  memo, key = _MEMO.get(), (id(lin), id(nx), layers)
  if key not in memo:
    memo[key] = _match_uncached(lin, nx, layers)
  return memo[key]


def _match_uncached(lin: _Node, nx: _Node, layers: int | None) -> Result:
  res = Result()
  if _is_sequence(nx) and not layers:
    return _match_stack(lin, nx)
  res.modules.append((lin.path, nx.path))
  _match_leaves(lin, nx, layers, res)
  lin_kids, nnx_kids = _children(lin), _children(nx)
  # Same names; Linen layers_3 vs NNX layers[3].
  for name in list(lin_kids):
    if name in nnx_kids:
      res.extend(_match(lin_kids.pop(name), nnx_kids.pop(name), layers))
      continue
    auto = _AUTO_NAME.fullmatch(name)
    if auto and _is_sequence(nnx_kids.get(auto["cls"])) and int(auto["index"]) in nnx_kids[auto["cls"]]:
      seq = nnx_kids[auto["cls"]]
      res.extend(_match(lin_kids.pop(name), seq.pop(int(auto["index"])), layers))
      if not seq:
        del nnx_kids[auto["cls"]]
  # NNX lists left over offer each element as a candidate too (Linen Block_0, Block_1 vs NNX blocks[0], blocks[1]).
  # A wrapper with nothing but one submodule offers that too (Linen's LSTMCell_0 vs NNX rnn.cell: nn.RNN holds
  # no variables of its own, so Linen names the cell beside it).
  candidates = {}

  def offer(key, node):
    candidates[key] = node
    if _is_sequence(node):
      candidates.update({key + (i,): el for i, el in node.items()})
    elif len(node) == 1 and isinstance(only := next(iter(node.values())), _Node):
      offer(key + (next(iter(node)),), only)

  for key, node in nnx_kids.items():
    offer((key,), node)
  fits = {ln: [ck for ck, cn in candidates.items() if _match(lin_kids[ln], cn, layers).complete] for ln in lin_kids}
  used: set = set()  # candidate keys no longer free
  claimed: set = set()  # candidate keys paired
  paired: set = set()  # Linen children paired
  position = {ck: i for i, ck in enumerate(candidates)}  # the NNX tree is already in definition order

  def take(ck):
    claimed.add(ck)
    used.add(ck)
    used.update(k for k in candidates if k[: len(ck)] == ck or ck[: len(k)] == k)

  for ln in lin_kids:
    free = [ck for ck in fits[ln] if ck not in used]
    if not free:
      continue  # left over: see below
    rivals = [x for x in lin_kids if x not in paired and set(fits[x]) & set(free)]
    if len(free) == 1 and len(rivals) == 1:
      chosen = free[0]
    else:
      autos = [_AUTO_NAME.fullmatch(x) for x in rivals]
      same_class = all(autos) and len({a["cls"] for a in autos}) == 1
      if not same_class or len(rivals) != len(free):
        res.ambiguous.append(
            (
                [path_str(lin_kids[x].path) for x in rivals],
                [path_str(candidates[ck].path) for ck in free],
                "alike in structure and shape, and their order is not known on both sides",
            )
        )
        for x in rivals:
          fits[x] = []
          paired.add(x)
        for ck in free:
          used.add(ck)
          claimed.add(ck)  # reported as ambiguous, not again as unmatched
        continue
      # Linen auto-names number modules of one class in the order they were made: pair with NNX definition order.
      rank = sorted(rivals, key=lambda x: int(_AUTO_NAME.fullmatch(x)["index"])).index(ln)
      chosen = sorted(free, key=position.get)[rank]
    res.extend(_match(lin_kids[ln], candidates[chosen], layers))
    paired.add(ln)
    take(chosen)
  # One Linen and one NNX submodule left, neither matching whole: match them as far as they go, so that the
  # plan names the leaves that differ (a missing bias) rather than every leaf of both.
  lin_left = [ln for ln in lin_kids if ln not in paired]
  nnx_left = [key for key in nnx_kids if not any(ck[:1] == (key,) for ck in claimed)]
  if len(lin_left) == 1 and len(nnx_left) == 1 and not _is_sequence(nnx_kids[nnx_left[0]]):
    res.extend(_match(lin_kids[lin_left[0]], nnx_kids[nnx_left[0]], layers))
    claimed.add((nnx_left[0],))
  else:
    for ln in lin_left:
      res.extend(_unmatched(lin_kids[ln], "linen"))
  for key, node in nnx_kids.items():
    if (key,) in claimed:
      continue
    if _is_sequence(node) and any(ck[:1] == (key,) for ck in claimed):
      for i, el in node.items():
        if (key, i) not in claimed:
          res.extend(_unmatched(el, "nnx"))
    elif not any(ck[:1] == (key,) for ck in claimed):
      res.extend(_unmatched(node, "nnx"))
  return res


def _match_stack(lin: _Node, seq: _Node) -> Result:
  """A Linen stack (every leaf with a layer axis) vs an NNX list of modules, one per layer."""
  layers = len(seq)
  first = seq[min(seq)]
  res = Result()
  res.extend(_match(lin, first, layers))
  if not res.complete:
    return res
  # Every element must hold what the first does; each stacked leaf takes one axis for its whole collection.
  shapes = {rel: leaf.shape for rel, leaf in _flat(first).items()}
  for i, el in seq.items():
    if {rel: leaf.shape for rel, leaf in _flat(el).items()} != shapes:
      res.ambiguous.append(([path_str(lin.path)], [path_str(el.path)], f"layer {i} differs in structure from layer 0"))
      return res
  by_collection: dict[str, set] = {}
  for a, b in res.links:
    axes = _stack_axes(a.shape, b.shape, layers)
    by_collection[a.collection] = by_collection.get(a.collection, axes) & axes
  links = []
  for a, b in res.links:
    axes = by_collection[a.collection]
    if len(axes) != 1:
      res.ambiguous.append(
          (
              [path_str(a.path)],
              [path_str(b.path)],
              f"stacked over {layers} layers on axes {sorted(axes)}: one layer axis per collection is needed",
          )
      )
      continue
    rel = b.path[len(first.path) :]
    targets = tuple(el.path + rel for el in seq.values())
    links.append(Link((a.path,), targets, op="stack", axis=next(iter(axes))))
  res.links = links
  res.modules = []
  res.stacks = [(lin.path, seq.path, layers)]
  return res


def _unmatched(node: _Node, side: str) -> Result:
  res = Result()
  leaves = list(_flat(node).values())
  (res.unmatched_linen if side == "linen" else res.unmatched_nnx).extend(leaves)
  return res


def match_modules(linen: Iterable[LinenLeaf], nnx_leaves: Iterable[NNXLeaf], nnx_module: Any) -> Result:
  """Matches the Linen leaves with the NNX leaves of `nnx_module` (read for its definition order), module by module."""
  nnx_root = _nnx_tree(nnx_leaves, nnx_module)
  token = _MEMO.set({})
  try:
    return _match(_linen_tree(linen), nnx_root)
  finally:
    _MEMO.reset(token)
