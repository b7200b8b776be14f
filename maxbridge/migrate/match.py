"""Which leaf of a Linen variables tree is which leaf of an NNX module's state: the plan.

A Linen tree is keyed by collection, then by module names (`Dense_0`, or the
name the author gave); an NNX state is keyed by attribute names, in the order
the author assigned them in `__init__`. The two trees name and order modules
differently but hold the same arrays, so the matching goes module by module:

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

User rules (regex on the Linen path -> NNX path, plus a transform) claim their
leaves before any of this. Collections pair by name: `params` with `nnx.Param`,
`batch_stats` with `nnx.BatchStat`, any Variable type registered with
`nnx.register_variable_name`; an unregistered custom type pairs with the one
Linen collection that no NNX type claims.
"""

from __future__ import annotations

import contextvars
import dataclasses
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import yaml
from flax import nnx
from flax.linen import meta as linen_meta
from flax.nnx import variablelib

# NNX state with no Linen counterpart: RNG keys and counts live in Linen's `rngs=` argument, not its variables.
DEFAULT_EXPECTED = (nnx.RngState,)
_AUTO_NAME = re.compile(r"(?P<cls>[A-Za-z_][A-Za-z0-9_]*?)_(?P<index>\d+)")


class MigrateError(ValueError):
  """A plan that cannot be applied, or trees that do not fit it; the message names every path at fault."""


def path_str(path: Sequence[Any]) -> str:
  return "/".join(str(p) for p in path)


@dataclasses.dataclass(frozen=True)
class LinenLeaf:
  path: tuple  # (collection, *module names, leaf name)
  shape: tuple
  dtype: Any
  box: Any = None  # the Partitioned / LogicallyPartitioned box it came in, re-applied on the way back

  @property
  def collection(self) -> str:
    return self.path[0]


@dataclasses.dataclass(frozen=True)
class NNXLeaf:
  path: tuple  # attribute names and list indices
  shape: tuple
  dtype: Any
  var_type: type
  collection: str  # the Linen collection its type corresponds to


@dataclasses.dataclass(frozen=True)
class Link:
  """Linen leaves -> NNX leaves. `op`: same (one to one), stack (one Linen stack to NNX leaves per layer),
  split (one Linen leaf to several NNX leaves), concat (several Linen leaves to one NNX leaf); `axis` for the
  last three. `transpose`/`reshape` apply (in that order) to a one-to-one link, Linen -> NNX."""

  linen: tuple[tuple, ...]
  nnx: tuple[tuple, ...]
  op: str = "same"
  axis: int = 0
  transpose: tuple[int, ...] | None = None
  reshape: tuple[int, ...] | None = None
  rule: str | None = None  # the user rule that made it

  @property
  def transformed(self) -> bool:
    return self.op != "same" or self.transpose is not None or self.reshape is not None

  def describe(self) -> str:
    lin = ", ".join(path_str(p) for p in self.linen)
    if self.op == "stack":
      target = f"{path_str(self.nnx[0])} .. {path_str(self.nnx[-1])} (stack axis {self.axis}, {len(self.nnx)} layers)"
    else:
      target = ", ".join(path_str(p) for p in self.nnx)
    how = []
    if self.op in ("split", "concat"):
      how.append(f"{self.op} axis {self.axis}")
    if self.transpose is not None:
      how.append(f"transpose {list(self.transpose)}")
    if self.reshape is not None:
      how.append(f"reshape {list(self.reshape)}")
    if self.rule:
      how.append(f"rule {self.rule!r}")
    return f"{lin} -> {target}" + (f"  [{'; '.join(how)}]" if how else "")


@dataclasses.dataclass(frozen=True)
class Rule:
  """A user's rule: Linen path regex (full match on 'collection/…/leaf') -> NNX path, plus a transform.

  `linen`/`nnx` are one pattern/template (`\\1` refers to a group), or lists of exact paths for `split`
  (one Linen leaf -> several NNX leaves) and `concat` (several Linen leaves -> one NNX leaf).
  """

  linen: str | tuple[str, ...]
  nnx: str | tuple[str, ...]
  transpose: tuple[int, ...] | None = None
  reshape: tuple[int, ...] | None = None
  split: int | None = None
  concat: int | None = None

  @classmethod
  def from_dict(cls, entry: Mapping[str, Any], where: str = "rule") -> "Rule":
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(entry) - known
    if unknown or "linen" not in entry or "nnx" not in entry:
      raise MigrateError(
          f"{where}: a rule has keys linen, nnx and optionally transpose, reshape, split, concat; got " f"{sorted(entry)}"
      )
    as_tuple = lambda v: tuple(v) if isinstance(v, (list, tuple)) else v
    rule = cls(**{k: as_tuple(v) for k, v in entry.items()})
    if rule.split is not None and not isinstance(rule.nnx, tuple):
      raise MigrateError(f"{where}: split needs a list of NNX paths, got nnx: {rule.nnx!r}")
    if rule.concat is not None and not isinstance(rule.linen, tuple):
      raise MigrateError(f"{where}: concat needs a list of Linen paths, got linen: {rule.linen!r}")
    return rule


def load_rules(path: str) -> tuple[Rule, ...]:
  """Rules from a YAML file: `rules: [{linen: REGEX, nnx: PATH, transpose: [1, 0]}, ...]`."""
  with open(path) as f:
    data = yaml.safe_load(f) or {}
  entries = data.get("rules") if isinstance(data, dict) else None
  if not isinstance(entries, list):
    raise MigrateError(f"{path}: expected a mapping with a list under 'rules', e.g. rules: [{{linen: ..., nnx: ...}}]")
  return tuple(Rule.from_dict(e, f"{path}: rules[{i}]") for i, e in enumerate(entries))


# ---------------------------------------------------------------- the two trees, flat


def _shape(x) -> tuple:
  return tuple(np.shape(x)) if not hasattr(x, "shape") else tuple(x.shape)


def linen_leaves(variables: Mapping[str, Any]) -> dict[tuple, LinenLeaf]:
  """Every leaf of a Linen variables tree by its path, boxes (Partitioned, ...) opened."""
  out = {}

  def walk(node, path):
    if isinstance(node, linen_meta.AxisMetadata):
      value = node.unbox()
      out[path] = LinenLeaf(path, _shape(value), getattr(value, "dtype", None), node)
    elif isinstance(node, Mapping):
      for key, child in node.items():
        walk(child, path + (str(key),))
    else:
      out[path] = LinenLeaf(path, _shape(node), getattr(node, "dtype", None))

  if not isinstance(variables, Mapping):
    raise MigrateError(
        f"Linen variables must be a mapping of collections (e.g. {{'params': ...}}), got {type(variables)}"
    )
  walk(variables, ())
  return out


def collection_of(var_type: type) -> str | None:
  """The Linen collection of an NNX Variable type (flax's own registry); None for an unregistered type."""
  try:
    return variablelib.variable_name_from_type(var_type)
  except ValueError:
    return None


def nnx_leaves(state: nnx.State) -> dict[tuple, tuple[type, Any]]:
  return {tuple(path): (type(var), var.get_value()) for path, var in nnx.to_flat_state(state)}


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


# ---------------------------------------------------------------- tree nodes for matching


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
class _Result:
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

  def extend(self, other: "_Result") -> None:
    for field in dataclasses.fields(self):
      getattr(self, field.name).extend(getattr(other, field.name))


def _stack_axes(linen_shape: tuple, nnx_shape: tuple, layers: int) -> set[int]:
  return {
      a
      for a in range(len(linen_shape))
      if linen_shape[a] == layers and linen_shape[:a] + linen_shape[a + 1 :] == nnx_shape
  }


def _match_leaves(lin: _Node, nx: _Node, layers: int | None, res: _Result) -> None:
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


def _match(lin: _Node, nx: _Node, layers: int | None = None) -> _Result:
  """Matches one Linen module (or stack, `layers` set) with one NNX module. The result is shared: extend, never edit."""
  memo, key = _MEMO.get(), (id(lin), id(nx), layers)
  if key not in memo:
    memo[key] = _match_uncached(lin, nx, layers)
  return memo[key]


def _match_uncached(lin: _Node, nx: _Node, layers: int | None) -> _Result:
  res = _Result()
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


def _match_stack(lin: _Node, seq: _Node) -> _Result:
  """A Linen stack (every leaf with a layer axis) vs an NNX list of modules, one per layer."""
  layers = len(seq)
  first = seq[min(seq)]
  res = _Result()
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


def _unmatched(node: _Node, side: str) -> _Result:
  res = _Result()
  leaves = list(_flat(node).values())
  (res.unmatched_linen if side == "linen" else res.unmatched_nnx).extend(leaves)
  return res


# ---------------------------------------------------------------- the plan


@dataclasses.dataclass
class Plan:
  """Every Linen leaf -> NNX leaf. Print it to read it; `check()` raises naming what is not covered."""

  links: list[Link]
  unmatched_linen: list[str]
  unmatched_nnx: list[str]
  ambiguous: list[tuple[list[str], list[str], str]]
  expected: list[str]  # NNX leaves listed as expected to have no Linen counterpart
  notes: list[str]
  linen_template: dict[tuple, LinenLeaf]
  nnx_template: dict[tuple, NNXLeaf]
  nnx_module: Any
  modules: list[tuple[tuple, tuple]]  # (Linen module path, NNX module path) pairs
  stacks: list[tuple[tuple, tuple, int]]  # (Linen stack, NNX list of its layers, layers)

  @property
  def matched(self) -> list[Link]:
    return [link for link in self.links if not link.transformed]

  @property
  def transformed(self) -> list[Link]:
    return [link for link in self.links if link.transformed]

  def __str__(self) -> str:
    lines = [
        f"migrate plan: {len(self.matched)} matched, {len(self.transformed)} transformed, "
        f"{len(self.unmatched_linen)} unmatched Linen, {len(self.unmatched_nnx)} unmatched NNX, "
        f"{len(self.ambiguous)} ambiguous, {len(self.expected)} expected without a counterpart"
    ]
    sections = [
        ("matched", [link.describe() for link in self.matched]),
        ("transformed", [link.describe() for link in self.transformed]),
        ("unmatched Linen", self.unmatched_linen),
        ("unmatched NNX", self.unmatched_nnx),
        ("ambiguous", [f"Linen {a} vs NNX {b}: {why}" for a, b, why in self.ambiguous]),
        ("expected without a counterpart (NNX)", self.expected),
        ("notes", self.notes),
    ]
    for title, items in sections:
      if items:
        lines.append(f"{title}:")
        lines.extend(f"  {item}" for item in items)
    return "\n".join(lines)

  def check(self) -> None:
    """Raises MigrateError naming every leaf the plan leaves uncovered, and every ambiguity."""
    problems = []
    if self.unmatched_linen:
      problems.append("Linen leaves with no NNX counterpart: " + ", ".join(self.unmatched_linen))
    if self.unmatched_nnx:
      problems.append(
          "NNX leaves with no Linen counterpart (they would keep their initial values): " + ", ".join(self.unmatched_nnx)
      )
    for a, b, why in self.ambiguous:
      problems.append(f"ambiguous: Linen {a} vs NNX {b} ({why})")
    if problems:
      raise MigrateError(
          "the migration plan does not cover every leaf:\n  "
          + "\n  ".join(problems + self.notes)
          + "\n  add a rule (regex -> path + transform), or list the leaves in expected_unmatched"
      )


def _expected(path: tuple, var_type: type, expected: Sequence[Any]) -> bool:
  for item in expected:
    if isinstance(item, type) and issubclass(var_type, item):
      return True
    if isinstance(item, str) and re.fullmatch(item, path_str(path)):
      return True
  return False


def _apply_rules(rules, lin: dict, nnx_side: dict) -> tuple[list[Link], list[str]]:
  """Links the user's rules make; claimed leaves leave `lin` and `nnx_side`. Errors name a rule that fits nothing."""
  by_name_lin = {path_str(p): p for p in lin}
  by_name_nnx = {path_str(p): p for p in nnx_side}
  links, problems = [], []

  def nnx_path(name, rule_text):
    if name not in by_name_nnx:
      problems.append(f"rule {rule_text}: NNX path {name!r} is not in the module's state")
      return None
    return by_name_nnx[name]

  for rule in rules:
    text = f"{rule.linen!r} -> {rule.nnx!r}"
    if rule.concat is not None:
      sources = [by_name_lin.get(n) for n in rule.linen]
      target = nnx_path(rule.nnx, text)
      if None in sources or target is None:
        problems.extend(
            f"rule {text}: Linen path {n!r} is not in the variables" for n in rule.linen if n not in by_name_lin
        )
        continue
      links.append(Link(tuple(sources), (target,), op="concat", axis=rule.concat, rule=text))
      continue
    hits = [n for n in by_name_lin if re.fullmatch(rule.linen, n)]
    if not hits:
      problems.append(f"rule {text}: no Linen path matches {rule.linen!r}")
    for name in hits:
      if rule.split is not None:
        targets = [nnx_path(n, text) for n in rule.nnx]
        if None not in targets:
          links.append(Link((by_name_lin[name],), tuple(targets), op="split", axis=rule.split, rule=text))
        continue
      target = nnx_path(re.sub(rule.linen, rule.nnx, name) if isinstance(rule.nnx, str) else "", text)
      if target is not None:
        links.append(Link((by_name_lin[name],), (target,), transpose=rule.transpose, reshape=rule.reshape, rule=text))
  for link in links:
    for p in link.linen:
      lin.pop(p, None)
    for p in link.nnx:
      nnx_side.pop(p, None)
  return links, problems


def _pair_collections(lin_collections: set, nnx_types: dict[type, str | None]) -> tuple[dict[type, str], list[str]]:
  """Linen collection of each NNX Variable type; an unregistered type takes the one Linen collection left."""
  named = {t: c for t, c in nnx_types.items() if c is not None}
  loose_types = [t for t, c in nnx_types.items() if c is None]
  loose_collections = sorted(lin_collections - set(named.values()))
  notes = []
  if len(loose_types) == 1 and len(loose_collections) == 1:
    named[loose_types[0]] = loose_collections[0]
    notes.append(f"NNX variable type {loose_types[0].__name__} holds Linen collection {loose_collections[0]!r}")
  else:
    for t in loose_types:
      named[t] = f"<{t.__name__}>"
      if loose_collections:
        notes.append(
            f"NNX variable type {t.__name__} is not registered and the Linen collections {loose_collections} are "
            "not claimed: name its collection with flax.nnx.register_variable_name"
        )
  return named, notes


def match(
    linen_variables: Mapping[str, Any],
    nnx_module: nnx.Module,
    rules: Sequence[Rule | Mapping[str, Any]] = (),
    expected_unmatched: Sequence[type | str] = DEFAULT_EXPECTED,
) -> Plan:
  """The plan mapping every leaf of `linen_variables` onto `nnx_module`'s state.

  `linen_variables` may hold arrays or `jax.ShapeDtypeStruct`s (`jax.eval_shape(module.init, ...)`), boxed or not;
  `nnx_module` may be abstract (`nnx.eval_shape`). `rules`: `Rule`s or their dicts (see `load_rules`).
  `expected_unmatched`: NNX Variable types or path regexes that have no Linen counterpart (default: RNG state).
  """
  rules = tuple(r if isinstance(r, Rule) else Rule.from_dict(r) for r in rules)
  lin = linen_leaves(linen_variables)
  raw = nnx_leaves(nnx.state(nnx_module))
  collections, notes = _pair_collections({p[0] for p in lin}, {t: collection_of(t) for t, _ in raw.values()})
  expected, nnx_side = [], {}
  for path, (var_type, value) in raw.items():
    leaf = NNXLeaf(path, _shape(value), getattr(value, "dtype", None), var_type, collections[var_type])
    if _expected(path, var_type, expected_unmatched):
      expected.append(f"{path_str(path)} ({var_type.__name__})")
    else:
      nnx_side[path] = leaf
  nnx_template = dict(nnx_side)
  lin_left = dict(lin)
  links, problems = _apply_rules(rules, lin_left, nnx_side)
  if problems:
    raise MigrateError("rules that do not fit these trees:\n  " + "\n  ".join(problems))
  nnx_root = _nnx_tree(nnx_side.values(), nnx_module)
  token = _MEMO.set({})
  try:
    res = _match(_linen_tree(lin_left.values()), nnx_root)
  finally:
    _MEMO.reset(token)
  for item in res.links:
    links.append(item if isinstance(item, Link) else Link((item[0].path,), (item[1].path,)))
  return Plan(
      links=links,
      unmatched_linen=[path_str(x.path) for x in res.unmatched_linen],
      unmatched_nnx=[f"{path_str(x.path)} ({x.var_type.__name__})" for x in res.unmatched_nnx],
      ambiguous=res.ambiguous,
      expected=expected,
      notes=notes + res.notes,
      linen_template=lin,
      nnx_template=nnx_template,
      nnx_module=nnx_module,
      modules=res.modules,
      stacks=res.stacks,
  )
