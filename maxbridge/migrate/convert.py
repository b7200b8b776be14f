"""Applying a plan: Linen variables <-> NNX state, an optax state that mirrors the parameters, and the step."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from maxbridge.migrate.leaves import Link, MigrateError, linen_leaves, path_str
from maxbridge.migrate.match import Plan


@dataclasses.dataclass
class Converted:
  """What `convert` made. Linen -> NNX: `state` (load it with `nnx.update(model, state)`); NNX -> Linen:
  `variables`. `opt_state` mirrors the target's parameters; `step` is passed through."""

  state: nnx.State | None = None
  variables: dict | None = None
  opt_state: Any = None
  step: Any = None


def _module_for(values: list):
  """numpy for concrete arrays (a checkpoint: no XLA compile per shape), jax.numpy under a trace."""
  return jnp if any(isinstance(v, jax.core.Tracer) for v in values) else np


def _array(value, xp):
  return jnp.asarray(value) if xp is np else value


def _to_nnx(link: Link, values: list, nnx_shapes: list) -> list:
  if link.transformed:
    xp = _module_for(values)
    return [_array(v, xp) for v in _to_nnx_with(xp, link, [xp.asarray(v) for v in values], nnx_shapes)]
  return values


def _to_linen(link: Link, values: list, linen_shapes: list) -> list:
  if link.transformed:
    xp = _module_for(values)
    return [_array(v, xp) for v in _to_linen_with(xp, link, [xp.asarray(v) for v in values], linen_shapes)]
  return values


def _to_nnx_with(xp, link: Link, values: list, nnx_shapes: list) -> list:
  if link.op == "stack":
    return [xp.take(values[0], i, axis=link.axis) for i in range(len(link.nnx))]
  if link.op == "split":
    sizes = np.cumsum([s[link.axis] for s in nnx_shapes])[:-1]
    return list(xp.split(values[0], sizes, axis=link.axis))
  if link.op == "concat":
    return [xp.concatenate(values, axis=link.axis)]
  value = values[0]
  if link.transpose is not None:
    value = xp.transpose(value, link.transpose)
  if link.reshape is not None:
    value = xp.reshape(value, link.reshape)
  return [value]


def _to_linen_with(xp, link: Link, values: list, linen_shapes: list) -> list:
  if link.op == "stack":
    return [xp.stack(values, axis=link.axis)]
  if link.op == "split":
    return [xp.concatenate(values, axis=link.axis)]
  if link.op == "concat":
    sizes = np.cumsum([s[link.axis] for s in linen_shapes])[:-1]
    return list(xp.split(values[0], sizes, axis=link.axis))
  value = values[0]
  if link.reshape is not None:  # back to the shape the transpose made
    shape = linen_shapes[0] if link.transpose is None else tuple(linen_shapes[0][i] for i in link.transpose)
    value = xp.reshape(value, shape)
  if link.transpose is not None:
    value = xp.transpose(value, np.argsort(link.transpose))
  return [value]


def check_shapes(given: Mapping[tuple, Any], template: Mapping[tuple, Any], side: str) -> None:
  missing = [path_str(p) for p in template if p not in given]
  extra = [path_str(p) for p in given if p not in template]
  wrong = [
      f"{path_str(p)} {tuple(np.shape(v))} (the plan has {template[p].shape})"
      for p, v in given.items()
      if p in template and tuple(np.shape(v)) != template[p].shape
  ]
  problems = (
      ([f"missing: {', '.join(missing)}"] if missing else [])
      + ([f"not in the plan: {', '.join(extra)}"] if extra else [])
      + ([f"wrong shape: {', '.join(wrong)}"] if wrong else [])
  )
  if problems:
    raise MigrateError(f"the {side} tree does not fit the plan it was matched with:\n  " + "\n  ".join(problems))


def linen_values(variables: Mapping[str, Any]) -> dict[tuple, Any]:
  return {
      path: (leaf.box.unbox() if leaf.box is not None else _get(variables, path))
      for path, leaf in linen_leaves(variables).items()
  }


def _get(tree, path):
  for key in path:
    tree = tree[key]
  return tree


def linen_to_nnx_values(plan: Plan, variables: Mapping[str, Any], collections: set | None = None) -> dict:
  """NNX path -> array for every linked leaf (only the links within `collections`, when given)."""
  values = linen_values(variables)
  template = {p: v for p, v in plan.linen_template.items() if collections is None or p[0] in collections}
  check_shapes(values, template, "Linen")
  out = {}
  for link in plan.links:
    if collections is not None and link.linen[0][0] not in collections:
      continue
    new = _to_nnx(link, [values[p] for p in link.linen], [plan.nnx_template[p].shape for p in link.nnx])
    out.update(zip(link.nnx, new))
  return out


def nnx_to_linen_values(plan: Plan, values: Mapping[tuple, Any], collections: set | None = None) -> dict:
  """Linen path -> array for every linked leaf, from NNX path -> array."""
  out = {}
  for link in plan.links:
    if collections is not None and link.linen[0][0] not in collections:
      continue
    missing = [path_str(p) for p in link.nnx if p not in values]
    if missing:
      raise MigrateError(f"the NNX state lacks {', '.join(missing)}, which the plan maps to {path_str(link.linen[0])}")
    new = _to_linen(link, [values[p] for p in link.nnx], [plan.linen_template[p].shape for p in link.linen])
    out.update(zip(link.linen, new))
  return out


def _flat_nnx(state) -> dict[tuple, Any]:
  if isinstance(state, nnx.Module):
    state = nnx.state(state)
  if isinstance(state, nnx.State):
    return {tuple(p): (v.get_value() if isinstance(v, nnx.Variable) else v) for p, v in nnx.to_flat_state(state)}
  raise MigrateError(f"expected an NNX module or nnx.State, got {type(state).__name__}")


def _linen_tree(values: Mapping[tuple, Any], plan: Plan, boxed: bool = True) -> dict:
  tree: dict = {}
  for path, value in values.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    box = plan.linen_template[path].box
    node[path[-1]] = box.replace_boxed(value) if boxed and box is not None else value
  return tree


def _fill_nnx(template: nnx.State, values: Mapping[tuple, Any]) -> nnx.State:
  flat = []
  for path, var in nnx.to_flat_state(template):
    path = tuple(path)
    if path in values:
      var = var.replace(values[path]) if isinstance(var, nnx.Variable) else values[path]
    flat.append((path, var))
  return nnx.from_flat_state(flat)


# ---------------------------------------------------------------- optimizer state


def _is_linen_mirror(node, paths: set) -> bool:
  if not isinstance(node, Mapping) or isinstance(node, nnx.State):
    return False
  try:
    return set(linen_leaves({"params": node})) == paths
  except MigrateError:
    return False


def _is_nnx_mirror(node, paths: set) -> bool:
  return isinstance(node, nnx.State) and {tuple(p) for p, _ in nnx.to_flat_state(node)} == paths


def _map_mirrors(node, template, is_mirror, convert_mirror, found: list):
  """`node` with every subtree that mirrors the parameters converted; the rest (counts, ...) kept.

  `template` (the target's optimizer state, or None) walks alongside to give each mirror its target form.
  """
  if is_mirror(node):
    found.append(True)
    return convert_mirror(node, template)
  if isinstance(node, tuple) and hasattr(node, "_fields"):  # optax's NamedTuple states
    return type(node)(*(_map_mirrors(v, _at(template, i), is_mirror, convert_mirror, found) for i, v in enumerate(node)))
  if isinstance(node, (tuple, list)):
    return type(node)(_map_mirrors(v, _at(template, i), is_mirror, convert_mirror, found) for i, v in enumerate(node))
  if isinstance(node, Mapping) and not isinstance(node, nnx.State):
    return {k: _map_mirrors(v, _at(template, k), is_mirror, convert_mirror, found) for k, v in node.items()}
  value = node.get_value() if isinstance(node, nnx.Variable) else node  # nnx.Optimizer's OptArray (a count)
  return template.replace(value) if isinstance(template, nnx.Variable) else value


def _at(template, key):
  if template is None:
    return None
  try:
    return template[key]
  except (KeyError, IndexError, TypeError):
    return None


def convert(
    plan: Plan,
    *,
    linen_variables: Mapping[str, Any] | None = None,
    nnx_state: nnx.State | nnx.Module | None = None,
    opt_state: Any = None,
    opt_template: Any = None,
    step: Any = None,
) -> Converted:
  """Applies `plan`: Linen -> NNX when given `linen_variables`, NNX -> Linen when given `nnx_state`.

  `opt_state`: an optax state over the source's parameters (`tx.init(variables['params'])`, or over
  `nnx.state(model, nnx.Param)`); every subtree of it shaped like the parameters is converted, the rest
  (counts, ...) kept. Its target form is the target's own: by default a dict (Linen) or the module's
  `nnx.State` of Params (NNX); `opt_template` (e.g. `tx.init(target_params)`, or an `nnx.Optimizer`'s
  `opt_state`) gives another, such as nnx.Optimizer's OptVariables. Raises MigrateError naming every leaf the
  plan leaves uncovered, or that the given tree lacks.
  """
  if (linen_variables is None) == (nnx_state is None):
    raise MigrateError("convert takes one of linen_variables (Linen -> NNX) or nnx_state (NNX -> Linen)")
  plan.check()
  params_links = [link for link in plan.links if link.linen[0][0] == "params"]
  linen_params = {p for link in params_links for p in link.linen}
  nnx_params = {p for link in params_links for p in link.nnx}
  found: list = []
  if linen_variables is not None:
    state = _fill_nnx(nnx.state(plan.nnx_module), linen_to_nnx_values(plan, linen_variables))
    converted = Converted(state=state, step=step)
    if opt_state is not None:
      default = nnx.state(plan.nnx_module, nnx.Param)

      def to_nnx(mirror, template):
        values = linen_to_nnx_values(plan, {"params": mirror}, {"params"})
        return _fill_nnx(template if isinstance(template, nnx.State) else default, values)

      converted.opt_state = _map_mirrors(
          opt_state, opt_template, lambda n: _is_linen_mirror(n, linen_params), to_nnx, found
      )
  else:
    values = _flat_nnx(nnx_state)
    check_shapes({p: v for p, v in values.items() if p in plan.nnx_template}, plan.nnx_template, "NNX")
    converted = Converted(variables=_linen_tree(nnx_to_linen_values(plan, values), plan), step=step)
    if opt_state is not None:

      def to_linen(mirror, template):
        del template  # a Linen optimizer state holds plain dicts
        linen = nnx_to_linen_values(plan, _flat_nnx(mirror), {"params"})
        return _linen_tree(linen, plan, boxed=False)["params"]

      converted.opt_state = _map_mirrors(
          opt_state, opt_template, lambda n: _is_nnx_mirror(n, nnx_params), to_linen, found
      )
  if opt_state is not None and not found and jax.tree.leaves(opt_state):
    raise MigrateError(
        "opt_state holds no subtree shaped like the parameters; pass the optax state made by tx.init(params)"
    )
  return converted
