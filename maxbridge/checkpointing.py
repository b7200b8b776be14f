"""Orbax checkpoints in MaxText's layout: `<dir>/<step>/items/` holding the on-disk tree.

Both backends save and restore the same tree (see `maxbridge.state`). Orbax
writes each step into a temporary folder and renames it when complete, so a
save killed midway leaves no step that restores half-written.
"""

import os
from typing import Any

import jax
import orbax.checkpoint as ocp

from converters import layouts

# Subtrees a loader may ignore: MaxText's NNX path saves its RNG state here.
IGNORED_SUBTREES = ("nnx_aux",)


class CheckpointError(ValueError):
  pass


def _paths(tree: Any) -> dict[str, Any]:
  leaves, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {layouts.keypath_str(path): leaf for path, leaf in leaves}


def _foreign_layout(tree: Any):
  """The layout of a checkpoint written in another layout (NNX, older MaxText NNX); None for ours.

  `converters.layouts` is the one place that maps layouts; an unknown tree
  is left to the path checks below, which name what does not match.
  """
  try:
    layout = layouts.detect(tree)
  except layouts.LayoutError:
    return None
  return None if layout.is_normal or layout.kind == layouts.CANONICAL else layout


def _params_first(item) -> tuple[bool, str]:
  # Parameters before their optimizer-state echoes: the first line is the one to read.
  path = item[0] if isinstance(item, tuple) else item
  return (not path.startswith("params/"), path)


class Checkpointer:
  """A CheckpointManager over `directory`, with checked restores."""

  def __init__(self, directory: str | os.PathLike, *, max_to_keep: int | None = None):
    self.directory = os.fspath(directory)
    self.manager = ocp.CheckpointManager(
        os.path.abspath(self.directory),
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True),
        # Named up front so metadata can be read before any save or restore.
        item_handlers={"items": ocp.PyTreeCheckpointHandler()},
    )

  def latest_step(self) -> int | None:
    return self.manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self.manager.all_steps())

  def save(self, step: int, tree: dict) -> None:
    """Starts an asynchronous save; arrays are copied off the live state before it returns."""
    self.manager.save(step, args=ocp.args.Composite(items=ocp.args.PyTreeSave(tree)))

  def wait(self) -> None:
    self.manager.wait_until_finished()

  def close(self) -> None:
    self.manager.close()

  def restore(self, step: int, target: dict) -> dict:
    """Restores `step` into the abstract `target` tree, after checking every path and shape."""
    if step not in self.manager.all_steps():
      raise CheckpointError(f"no checkpoint for step {step} in {self.directory}; available: {self.all_steps()}")
    stored_tree = self.manager.item_metadata(step)["items"].tree
    layout = _foreign_layout(stored_tree)
    stored = _paths(layouts.normalize(stored_tree, layout) if layout else stored_tree)
    wanted = _paths(target)
    where = f"checkpoint {os.path.join(self.directory, str(step))}"
    missing = sorted(set(wanted) - set(stored), key=_params_first)
    unknown = sorted(
        (p for p in set(stored) - set(wanted) if p.split("/")[0] not in IGNORED_SUBTREES),
        key=_params_first,
    )
    if missing or unknown:
      lines = [f"  missing: {p} {tuple(wanted[p].shape)}" for p in missing[:20]]
      lines += [f"  unexpected: {p}" for p in unknown[:20]]
      raise CheckpointError(f"{where} does not match the model:\n" + "\n".join(lines))
    misshaped = [
        f"  {path} has shape {tuple(stored[path].shape)}, the model expects {tuple(want.shape)}"
        for path, want in sorted(wanted.items(), key=_params_first)
        if tuple(stored[path].shape) != tuple(want.shape)
    ]
    if misshaped:
      more = f"\n  ... and {len(misshaped) - 20} more" if len(misshaped) > 20 else ""
      raise CheckpointError(f"{where} does not match the model:\n" + "\n".join(misshaped[:20]) + more)
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None) or device),
        target,
    )
    # A checkpoint in another layout is read in its own structure, then renamed.
    on_disk = layouts.stored_like(stored_tree, layout, target) if layout else target
    restored = self.manager.restore(
        step,
        args=ocp.args.Composite(
            items=ocp.args.PyTreeRestore(
                on_disk,
                restore_args=ocp.checkpoint_utils.construct_restore_args(on_disk),
                # Only the ignored subtrees can be left behind: checked above.
                partial_restore=True,
            )
        ),
    )
    return layouts.normalize(restored["items"], layout) if layout else restored["items"]
