"""A Grain pipeline's iterator state as a checkpoint item, written and read by Grain's own orbax handler.

`core.checkpointing.Checkpointer` knows nothing of Grain: it saves the item a run gives it (`save(..., data=)`)
beside the state, and restores one (`restore_data`), under its `DATA` name, with the handler registered for that
name. This module registers Grain's when it is imported, which `grain_data` does: a run on a Grain pipeline has
built its dataset (`data.make_dataset`) before it makes its `Checkpointer`. In the step's `data/` folder: one
JSON file per process.
"""

from __future__ import annotations

import json

import grain.checkpoint

from maxbridge.core import checkpointing

checkpointing.register_item(checkpointing.DATA, grain.checkpoint.CheckpointHandler)


class Snapshot:
  """A data iterator's state, frozen when a checkpoint starts: Grain's handler writes it whenever orbax gets to it.

  Its state is JSON bytes: the form Grain's handler takes from an iterator that is not one of its own.
  """

  def __init__(self, state: dict):
    self.state = json.dumps(state, indent=1).encode()

  def get_state(self) -> bytes:
    return self.state


def save_item(state: dict) -> grain.checkpoint.CheckpointSave:
  """The iterator state `state` (JSON), frozen now: Grain's handler reads it from another thread, later."""
  return grain.checkpoint.CheckpointSave(Snapshot(state))


def restore_item(iterator) -> grain.checkpoint.CheckpointRestore:
  """What sets `iterator` (anything with `set_state`, taking JSON bytes) to the state saved with a step."""
  return grain.checkpoint.CheckpointRestore(iterator)
