"""Which leaf of a Linen variables tree is which leaf of an NNX module's state: the plan.

A Linen tree is keyed by collection, then by module names (`Dense_0`, or the
name the author gave); an NNX state is keyed by attribute names, in the order
the author assigned them in `__init__`. The two trees name and order modules
differently but hold the same arrays, so the matching goes module by module
(`structure`: leaves by name, then by shape; submodules by name, then by
structure and shape; a Linen stack against an NNX list of layers).

User rules (regex on the Linen path -> NNX path, plus a transform) claim their
leaves before any of this. Collections pair by name: `params` with `nnx.Param`,
`batch_stats` with `nnx.BatchStat`, any Variable type registered with
`nnx.register_variable_name`; an unregistered custom type pairs with the one
Linen collection that no NNX type claims.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from typing import Any

import yaml
from flax import nnx

from maxbridge.migrate import structure
from maxbridge.migrate.leaves import (
    LinenLeaf,
    Link,
    MigrateError,
    NNXLeaf,
    collection_of,
    linen_leaves,
    nnx_leaves,
    path_str,
    shape_of,
)

# NNX state with no Linen counterpart: RNG keys and counts live in Linen's `rngs=` argument, not its variables.
DEFAULT_EXPECTED = (nnx.RngState,)


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
    """A rule from its YAML/dict form; MigrateError naming `where`, the key at fault and what would be valid."""
    if not isinstance(entry, Mapping):
      raise MigrateError(f"{where}: a rule is a mapping such as {{linen: REGEX, nnx: PATH}}, got {entry!r}")
    known = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(str(k) for k in entry if k not in known)
    missing = [k for k in ("linen", "nnx") if k not in entry]
    if unknown or missing:
      raise MigrateError(
          f"{where}: a rule has keys linen, nnx and optionally transpose, reshape, split, concat; got "
          f"{sorted(map(str, entry))}"
          + (f" (unknown: {', '.join(unknown)})" if unknown else "")
          + (f" (missing: {', '.join(missing)})" if missing else "")
      )
    for key in ("split", "concat"):
      if entry.get(key) is not None and not _is_int(entry[key]):
        raise MigrateError(f"{where}: {key} is the axis to {key} along, an integer such as -1; got {entry[key]!r}")
    for key in ("transpose", "reshape"):
      value = entry.get(key)
      if value is not None and not (isinstance(value, (list, tuple)) and value and all(map(_is_int, value))):
        raise MigrateError(f"{where}: {key} is a list of integers such as [1, 0]; got {value!r}")
    # A list on one side means several leaves (split: one Linen leaf to several NNX leaves; concat: the reverse).
    for key, listed_by in (("linen", "concat"), ("nnx", "split")):
      value = entry[key]
      if entry.get(listed_by) is not None:
        if not (isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value)):
          side = "Linen" if key == "linen" else "NNX"
          raise MigrateError(f"{where}: {listed_by} needs a list of {side} paths under {key}, got {key}: {value!r}")
      elif not isinstance(value, str):
        kind = "a regex on the Linen path" if key == "linen" else "an NNX path (\\1 for a group of the regex)"
        raise MigrateError(
            f"{where}: {key} is {kind}, a string such as 'params/Dense_0/(.*)'; got {value!r}"
            + (f" (a list is for {listed_by}: {key} paths with {listed_by}: AXIS)" if isinstance(value, list) else "")
        )
    if entry.get("split") is not None and entry.get("concat") is not None:
      raise MigrateError(f"{where}: a rule either splits or concatenates, not both")
    if isinstance(entry["linen"], str):
      try:
        re.compile(entry["linen"])
      except re.error as e:
        raise MigrateError(f"{where}: linen {entry['linen']!r} is not a valid regular expression: {e}") from None
    as_tuple = lambda v: tuple(v) if isinstance(v, (list, tuple)) else v
    return cls(**{k: as_tuple(v) for k, v in entry.items()})


def _is_int(value) -> bool:
  return isinstance(value, int) and not isinstance(value, bool)


_RULES_FORM = "rules: [{linen: REGEX, nnx: PATH}, ...] (optionally transpose, reshape, split, concat)"


def load_rules(path: str) -> tuple[Rule, ...]:
  """Rules from a YAML (or JSON) file: `rules: [{linen: REGEX, nnx: PATH, transpose: [1, 0]}, ...]`.

  Raises MigrateError naming the file, the rule and the key at fault, and what would be valid."""
  try:
    with open(path) as f:
      data = yaml.safe_load(f)
  except OSError as e:
    raise MigrateError(f"rules file {path}: cannot read it: {e.strerror or e}") from None
  except yaml.YAMLError as e:
    # YAML's message carries the line and column; JSON is YAML too.
    raise MigrateError(f"rules file {path}: not valid YAML or JSON: {' '.join(str(e).split())}") from None
  entries = data.get("rules") if isinstance(data, dict) else None
  if not isinstance(entries, list):
    got = f"keys {sorted(map(str, data))}" if isinstance(data, dict) else f"a {type(data).__name__}"
    raise MigrateError(f"rules file {path}: expected a mapping with a list under 'rules', {_RULES_FORM}; got {got}")
  if isinstance(data, dict) and set(data) - {"rules"}:
    raise MigrateError(
        f"rules file {path}: unknown top-level keys {sorted(map(str, set(data) - {'rules'}))}; the file holds only "
        f"{_RULES_FORM}"
    )
  return tuple(Rule.from_dict(e, f"rules file {path}: rules[{i}]") for i, e in enumerate(entries))


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
    hits = {n: m for n in by_name_lin if (m := re.fullmatch(rule.linen, n))}
    if not hits:
      problems.append(f"rule {text}: no Linen path matches {rule.linen!r}")
    for name, found in hits.items():
      if rule.split is not None:
        targets = [nnx_path(n, text) for n in rule.nnx]
        if None not in targets:
          links.append(Link((by_name_lin[name],), tuple(targets), op="split", axis=rule.split, rule=text))
        continue
      if not isinstance(rule.nnx, str):
        problems.append(f"rule {text}: a list of NNX paths needs split: AXIS; one NNX path is a string")
        break
      try:
        # expand, not re.sub: a pattern that also matches the empty string at the end ('.*') would repeat it.
        target_name = found.expand(rule.nnx)
      except re.error as e:  # a group the regex does not have (\3), a bad escape
        problems.append(f"rule {text}: NNX path template {rule.nnx!r} does not fit the regex: {e}")
        break
      target = nnx_path(target_name, text)
      if target is not None:
        links.append(Link((by_name_lin[name],), (target,), transpose=rule.transpose, reshape=rule.reshape, rule=text))
  for link in links:
    for p in link.linen:
      lin.pop(p, None)
    for p in link.nnx:
      nnx_side.pop(p, None)
  return links, problems


def _rule_modules(links: Sequence[Link], paired: Sequence[tuple[tuple, tuple]]) -> list[tuple[tuple, tuple]]:
  """(Linen module, NNX module) pairs the rules imply: every leaf of the one maps one to one into the other.

  `compare` only compares the calls of paired modules; a module whose leaves the rules claimed would otherwise
  never be, and a difference in it would surface (and be blamed) only at a later call.
  """
  targets: dict[tuple, set] = {}
  for link in links:
    for lin in link.linen:
      # split/concat spread one module over several: no one module of the other side computes what it does.
      target = link.nnx[0][:-1] if link.op == "same" else None
      targets.setdefault(lin[1:-1], set()).add(target)
  taken_linen = {lin for lin, _ in paired}
  taken_nnx = {nx for _, nx in paired}
  pairs = []
  for lin, nxs in targets.items():
    if len(nxs) == 1 and None not in nxs and lin not in taken_linen and (nx := next(iter(nxs))) not in taken_nnx:
      pairs.append((lin, nx))
      taken_nnx.add(nx)
  return pairs


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

  `linen_variables` may hold arrays or `jax.ShapeDtypeStruct`s (`jax.evalshape_of(module.init, ...)`), boxed or not;
  `nnx_module` may be abstract (`nnx.eval_shape`). `rules`: `Rule`s or their dicts (see `load_rules`).
  `expected_unmatched`: NNX Variable types or path regexes that have no Linen counterpart (default: RNG state).
  """
  rules = tuple(r if isinstance(r, Rule) else Rule.from_dict(r) for r in rules)
  lin = linen_leaves(linen_variables)
  raw = nnx_leaves(nnx.state(nnx_module))
  collections, notes = _pair_collections({p[0] for p in lin}, {t: collection_of(t) for t, _ in raw.values()})
  expected, nnx_side = [], {}
  for path, (var_type, value) in raw.items():
    leaf = NNXLeaf(path, shape_of(value), getattr(value, "dtype", None), var_type, collections[var_type])
    if _expected(path, var_type, expected_unmatched):
      expected.append(f"{path_str(path)} ({var_type.__name__})")
    else:
      nnx_side[path] = leaf
  nnx_template = dict(nnx_side)
  lin_left = dict(lin)
  links, problems = _apply_rules(rules, lin_left, nnx_side)
  if problems:
    raise MigrateError("rules that do not fit these trees:\n  " + "\n  ".join(problems))
  res = structure.match_modules(lin_left.values(), nnx_side.values(), nnx_module)
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
      modules=res.modules + _rule_modules([link for link in links if link.rule], res.modules),
      stacks=res.stacks,
  )
