"""A new run's first state: from the seed, or from a checkpoint MaxText's load keys name (`load_full_state_path`:
parameters, optimizer state and step; `load_parameters_path`: parameters alone), in any layout and scan form."""

import jax
import jax.numpy as jnp

from maxbridge.core import canonical, checkpointing, layouts, sharding
from maxbridge.core.config import Config
from maxbridge.ops import quantization


def initial_state(config: Config, trainer):
  """A new run's first state: MaxText's load_full_state_path (parameters, optimizer state and step)
  or load_parameters_path (parameters; a fresh optimizer at step 0), else initialised from the seed.

  Either path is a `<step>/items` or step folder in any layout `maxbridge.layouts` reads,
  scanned or not: the layers are stacked or unstacked to fit this run.
  """
  if config.load_full_state_path:
    return _full_state(config.load_full_state_path, trainer)
  if not config.load_parameters_path:
    return trainer.init_state(config.seed)
  where = f"load_parameters_path={config.load_parameters_path!r}"
  params = _named(where, checkpointing.load_params, config.load_parameters_path)[0]
  if quantization.is_serve_tree(params):
    raise checkpointing.CheckpointError(
        f"{where} holds a quantized serve checkpoint (int8 kernel_qvalue/kernel_scale, no float kernels), "
        "which cannot be trained; start from the float checkpoint it was made from"
    )
  params = _fit(params, trainer, where)
  state = trainer.init_state(config.seed)  # a fresh optimizer state at step 0
  with sharding.active(trainer.mesh, trainer.rules):
    replace = jax.jit(trainer.replace_params, out_shardings=trainer.state_shardings, donate_argnums=0)
    return replace(state, params)


def _named(where: str, read, path):
  try:
    return read(path)
  except checkpointing.CheckpointError as e:
    raise checkpointing.CheckpointError(f"{where}: {e}") from e


def _fit(params, trainer, where: str) -> dict:
  try:
    return canonical.conform(params, trainer.abstract_params, trainer.config.param_scan_axis)
  except ValueError as e:
    raise checkpointing.CheckpointError(f"{where}: {e}") from e


def _full_state(path: str, trainer):
  where = f"load_full_state_path={path!r}"
  # Read array by array on the host, so that any layout and either scan form can be
  # reshaped to this run's before the arrays go to their shardings.
  reader = _named(where, checkpointing.CheckpointReader, path)
  if reader.layout.params_only:
    raise checkpointing.CheckpointError(
        f"{where}: {reader.items} holds parameters only ({reader.layout.describe()}); "
        "start from it with load_parameters_path instead"
    )
  tree = layouts.build_tree({p: reader.read(p) for p in reader.leaves}, layouts.LINEN)
  target = trainer.checkpoint_target()
  want = _leaf_paths(target)
  got = _parameter_shaped(_leaf_paths(tree), want, trainer.config.param_scan_axis, where)
  if set(got) != set(want):
    lines = [f"  missing: {p}" for p in sorted(set(want) - set(got))[:20]]
    lines += [f"  unexpected: {p}" for p in sorted(set(got) - set(want))[:20]]
    raise checkpointing.CheckpointError(
        f"{where}: {reader.items} holds another optimizer's state than this run's "
        f"(opt_type={trainer.config.opt_type}):\n" + "\n".join(lines)
    )
  placed = {p: jax.device_put(jnp.asarray(got[p], want[p].dtype), want[p].sharding) for p in want}
  leaves = [placed[p] for p in _leaf_paths(target)]
  return trainer.from_checkpoint(jax.tree.unflatten(jax.tree.structure(target), leaves))


def _parameter_shaped(got: dict, want: dict, axis: int, where: str) -> dict:
  """`got` (a checkpoint's leaves by path) with each part shaped like the parameters in the scan form of this
  run's `want`: the parameters, and in the optimizer state Adam's mu and nu or Muon's momentum, whole or masked
  to the leaves one transform updates (so matched by path, not by structure). Such a part is what lies under a
  `params/` in its path; the rest (counts, coefficients) is taken as it is."""
  parts: dict[str, dict] = {}
  out = {}
  for path, value in got.items():
    prefix, params, rest = path.partition("/params/")
    if params:
      parts.setdefault(f"{prefix}/params", {})[rest] = value
    else:
      out[path] = value
  for prefix, part in parts.items():
    abstract = {p.removeprefix(f"{prefix}/"): leaf for p, leaf in want.items() if p.startswith(f"{prefix}/")}
    if abstract:  # else nothing of this run's is so named: the caller reports the paths as unexpected
      try:
        part = canonical.flatten(canonical.conform(canonical.unflatten(part), canonical.unflatten(abstract), axis))
      except ValueError as e:
        owner = "" if prefix == "params/params" else f", optimizer state {prefix.removeprefix('opt_state/')}"
        raise checkpointing.CheckpointError(f"{where}{owner}: {e}") from e
    out.update({f"{prefix}/{p}": value for p, value in part.items()})
  return out


def _leaf_paths(tree) -> dict:
  return {layouts.keypath_str(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}
