"""What `maxbridge migrate check` and `maxbridge migrate convert` run: the user's factories, orbax checkpoints.

A factory is the user's own function that builds a module, named `package.module:function` or
`path/to/file.py:function`. The NNX factory may return the module, or `(module, nnx.Optimizer)` when the
optimizer state should come along.

A Linen checkpoint is what a plain Linen loop saves with orbax: a `flax.training.train_state.TrainState`
(its `step`, `params`, `opt_state`, and any collection such as `batch_stats` a subclass adds), or a bare
variables dict. The NNX checkpoint written is `{"model": <the module's state>, "optimizer": <the
nnx.Optimizer's state>}` as pure dicts: the twin restores it with `nnx.update(model, restored["model"])` and
`nnx.update(optimizer, restored["optimizer"])`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core import files
from maxbridge.migrate.compare import Comparison, compare
from maxbridge.migrate.convert import check_shapes, convert, linen_values
from maxbridge.migrate.leaves import MigrateError, linen_leaves
from maxbridge.migrate.match import Plan, load_rules, match

_TAG = "migrate"
_NOT_COLLECTIONS = ("step", "opt_state")


def load_factory(spec: str) -> Callable[[], Any]:
  """The function `spec` names: `package.module:function` or `path/to/file.py:function`."""
  module_name, sep, attr = spec.rpartition(":")
  if not sep or not module_name or not attr:
    raise MigrateError(f"factory {spec!r}: expected package.module:function or path/to/file.py:function")
  try:
    if module_name.endswith(".py"):
      path = Path(module_name)
      if not path.is_file():
        raise MigrateError(f"factory {spec!r}: no file {path}")
      loaded = importlib.util.spec_from_file_location(path.stem, path)
      module = importlib.util.module_from_spec(loaded)
      sys.modules.setdefault(path.stem, module)
      loaded.loader.exec_module(module)
    else:
      # As `python -m` would: the user's package in the working directory, for the `maxbridge` script too.
      if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.append(os.getcwd())
      module = importlib.import_module(module_name)
  except ImportError as e:
    raise MigrateError(f"factory {spec!r}: cannot import {module_name}: {e}") from None
  factory = getattr(module, attr, None)
  if not callable(factory):
    raise MigrateError(f"factory {spec!r}: {module_name} has no function {attr!r}")
  return factory


def _nnx_parts(built) -> tuple[nnx.Module, nnx.Optimizer | None]:
  model, optimizer = (built if isinstance(built, tuple) else (built, None))[:2]
  if not isinstance(model, nnx.Module) or (optimizer is not None and not isinstance(optimizer, nnx.Optimizer)):
    raise MigrateError(
        f"the NNX factory must return an nnx.Module or (nnx.Module, nnx.Optimizer), got {type(built).__name__}"
    )
  return model, optimizer


def _match(variables: Mapping[str, Any], model: nnx.Module, rules: str | None) -> Plan:
  try:
    return match(variables, model, load_rules(rules) if rules else ())
  except MigrateError as e:
    if rules and str(e).startswith("rules that do not fit"):  # name the file the user has to edit
      raise MigrateError(f"rules file {rules}: {e}") from None
    raise


def parse_shape(text: str) -> tuple[int, ...]:
  try:
    shape = tuple(int(x) for x in text.split(","))
  except ValueError:
    shape = ()
  if not shape or any(n <= 0 for n in shape):
    raise MigrateError(f"--input-shape {text!r}: expected positive integers separated by commas, e.g. 2,28,28,1")
  return shape


def _random_inputs(input_shape: Sequence[int], seed: int) -> tuple:
  return (jax.random.normal(jax.random.key(seed + 1), tuple(input_shape)),)


def check(
    linen: str,
    nnx_factory: str,
    input_shape: Sequence[int],
    *,
    rules: str | None = None,
    linen_kwargs: Mapping[str, Any] | None = None,
    seed: int = 0,
    atol: float = 1e-6,
) -> tuple[Plan, Comparison]:
  """Builds both modules, initialises Linen on random inputs, matches, converts, and compares (eval mode)."""
  linen_module = load_factory(linen)()
  model, _ = _nnx_parts(load_factory(nnx_factory)())
  _check_input_shape(input_shape, linen_module, model, linen_kwargs)
  inputs = _random_inputs(input_shape, seed)
  variables = linen_module.init(jax.random.key(seed), *inputs, **dict(linen_kwargs or {}))
  plan = _match(variables, model, rules)
  plan.check()
  return plan, compare(linen_module, model, inputs, variables=variables, plan=plan, linen_kwargs=linen_kwargs, atol=atol)


def _check_input_shape(input_shape, linen_module, model: nnx.Module, linen_kwargs) -> None:
  """An --input-shape that either model cannot take is named as such, before any weights are matched: a Linen
  model initialised for it would otherwise show only as leaves its twin lacks, or fail deep in its own code."""
  shape, x = ",".join(map(str, input_shape)), jax.ShapeDtypeStruct(tuple(input_shape), jnp.float32)
  graphdef, state = nnx.split(model)
  runs = {
      "the Linen model": lambda: jax.eval_shape(
          lambda x: linen_module.init(jax.random.key(0), x, **dict(linen_kwargs or {})), x
      ),
      "its NNX twin": lambda: jax.eval_shape(lambda state, x: nnx.merge(graphdef, state)(x), state, x),
  }
  for name, run in runs.items():
    try:
      run()
    except Exception as e:  # the user's model decides what fits it: whatever it raises says why
      why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise MigrateError(
          f"--input-shape {shape} does not fit {name} ({type(e).__name__}: {why}); give the shape of one batch of "
          "its inputs, e.g. --input-shape 2,28,28,1 for two 28x28 single-channel images"
      ) from e


def item_directory(source: str | os.PathLike) -> Path:
  """The orbax item folder in `source`: itself, its one item, or that of a CheckpointManager's latest step."""
  source = Path(source)
  if not source.is_dir():
    raise MigrateError(f"{source}: no such checkpoint directory")
  if (source / "_METADATA").exists():
    return source
  steps = sorted((p for p in source.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
  if steps:
    return item_directory(steps[-1])
  items = [p for p in source.iterdir() if p.is_dir() and (p / "_METADATA").exists()]
  if len(items) == 1:
    return items[0]
  raise MigrateError(
      f"{source}: not an orbax checkpoint (no _METADATA in it, in one item folder, or in a numbered step folder)"
  )


def _read(source: Path) -> dict:
  import orbax.checkpoint as ocp

  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(source)
  if not isinstance(restored, Mapping):
    raise MigrateError(f"{source}: expected a TrainState or a variables dict, got {type(restored).__name__}")
  return dict(restored)


def convert_checkpoint(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    linen: str,
    nnx_factory: str,
    *,
    rules: str | None = None,
    input_shape: Sequence[int] | None = None,
    linen_kwargs: Mapping[str, Any] | None = None,
    atol: float = 1e-6,
    allow_mismatch: bool = False,
    seed: int = 0,
    log: Callable[[str], None] = lambda text: print(text, file=sys.stderr),
) -> tuple[Plan, Comparison | None]:
  """Converts the Linen orbax checkpoint `source` into an NNX one at `destination` (which must not exist).

  Before writing, both modules run on the checkpoint's weights (random inputs of `input_shape`) and are
  compared as `check` compares them: if they differ beyond `atol`, MigrateError with the comparison and nothing
  written, unless `allow_mismatch` (then a warning). Without `input_shape` nothing can be compared: refused
  unless `allow_mismatch`. The checkpoint must hold the Linen module's variables, shape for shape. Writes to a
  folder beside `destination`, renamed into place when complete. Returns the plan and the comparison (None
  when not compared).
  """
  # orbax takes only absolute paths ("should be absolute"); the user's may be relative to where they are.
  source, destination = Path(source).absolute(), Path(destination).absolute()
  if destination.exists():
    raise MigrateError(f"{destination} exists; migrate convert never overwrites: choose a new directory")
  if not destination.parent.is_dir():
    raise MigrateError(f"{destination.parent}: no such directory to write {destination.name} into")
  if input_shape is None and not allow_mismatch:
    raise MigrateError(
        "migrate convert compares the NNX twin's outputs with the Linen model's before it writes, on random inputs "
        "of --input-shape: give it (e.g. --input-shape 2,28,28,1), or --allow-mismatch to write without comparing"
    )
  item = item_directory(source)
  log(f"reading {item}")
  raw = _read(item)
  variables = {k: v for k, v in raw.items() if k not in _NOT_COLLECTIONS and isinstance(v, Mapping)}
  if "params" not in variables:
    raise MigrateError(f"{item}: no 'params' in the checkpoint (it holds {sorted(raw)})")
  linen_module = load_factory(linen)()
  model, optimizer = _nnx_parts(load_factory(nnx_factory)())
  if input_shape is not None:
    _check_input_shape(input_shape, linen_module, model, linen_kwargs)
    abstract = jax.eval_shape(
        lambda: linen_module.init(jax.random.key(0), jnp.zeros(tuple(input_shape)), **dict(linen_kwargs or {}))
    )
    check_shapes(linen_values(variables), linen_leaves(abstract), "checkpoint")
  plan = _match(variables, model, rules)
  log(plan.__str__().splitlines()[0])
  plan.check()
  comparison = None
  if input_shape is not None:
    comparison = compare(
        linen_module,
        model,
        _random_inputs(input_shape, seed),
        variables=variables,
        plan=plan,
        linen_kwargs=linen_kwargs,
        atol=atol,
    )
    if not comparison.ok and not allow_mismatch:
      raise MigrateError(
          "the NNX twin does not compute what the Linen model does on this checkpoint's weights: restored from "
          f"it, the twin would not give your trained model's outputs; nothing written to {destination}.\n"
          f"{comparison}\nFix the twin (maxbridge migrate check reports the same on random weights), loosen "
          "--atol, or pass --allow-mismatch to write it anyway"
      )
    log(str(comparison))
    if not comparison.ok:
      log(
          f"warning: writing despite the difference (--allow-mismatch): outputs max |diff| "
          f"{comparison.output_max_abs:.3g} > atol {atol:g}"
      )
  else:
    log("warning: the twin's outputs were not compared with the Linen model's (--allow-mismatch, no --input-shape)")
  opt_state = raw.get("opt_state")
  converted = convert(
      plan,
      linen_variables=variables,
      opt_state=opt_state if optimizer is not None else None,
      opt_template=optimizer.opt_state if optimizer is not None else None,
      step=raw.get("step"),
  )
  nnx.update(model, converted.state)
  tree = {"model": nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.RngState)))}
  if optimizer is not None:
    optimizer.opt_state = converted.opt_state
    if converted.step is not None:
      optimizer.step[...] = jnp.asarray(converted.step, optimizer.step[...].dtype)
    tree["optimizer"] = nnx.to_pure_dict(nnx.state(optimizer))
  elif opt_state is not None:
    log("note: optimizer state not written: the NNX factory returned no nnx.Optimizer to hold it")
  _write(destination, tree, log)
  return plan, comparison


def _write(destination: Path, tree: dict, log: Callable[[str], None]) -> None:
  import orbax.checkpoint as ocp

  staging = files.temp_dir_beside(destination, _TAG)
  try:
    arrays = len(jax.tree.leaves(tree))
    log(f"writing {arrays} arrays to {destination}")
    with ocp.StandardCheckpointer() as checkpointer:
      checkpointer.save(staging / "state", tree)
      checkpointer.wait_until_finished()
    if destination.exists():
      raise MigrateError(f"{destination} appeared while converting; nothing written")
    os.replace(staging / "state", destination)
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  log(f"wrote {destination}")
