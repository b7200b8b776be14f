"""Where each decode slot is, kept on the host, and the position where a slot must stop."""

import weakref

import numpy as np

from maxbridge.core import canonical
from maxbridge.core.config import Config
from maxbridge.models import decoding
from maxbridge.ops import kv_cache


class HostPositions:
  """The values of the `next_pos` arrays an engine made, kept on the host by array.

  What each step does to them is known without looking (a busy slot moves on
  by one, an idle one stays at 0), so checking a step's room never waits for
  the step before it: a read from the device would cost the overlap of
  dispatch and compute, ~1.5x the time of a tiny model's step on CPU. An
  array made elsewhere is read.
  """

  def __init__(self):
    self._by_id: dict[int, tuple[weakref.ref, np.ndarray]] = {}

  def put(self, array, values) -> None:
    key = id(array)

    def forget(ref, key=key):
      if self._by_id.get(key, (None,))[0] is ref:
        del self._by_id[key]

    self._by_id[key] = (weakref.ref(array, forget), np.array(values, np.int32))

  def get(self, array) -> np.ndarray:
    if isinstance(array, (np.ndarray, np.integer, int)):
      return np.asarray(array, np.int32)
    ref, values = self._by_id.get(id(array), (None, None))
    return values if ref is not None and ref() is array else np.asarray(array, np.int32)


def advanced(next_pos: np.ndarray, steps: int) -> np.ndarray:
  """`next_pos` after `steps` decode steps: busy slots move on, idle ones (0) stay."""
  return np.where(next_pos > 0, next_pos + steps, 0).astype(np.int32)


def position_limit(config: Config) -> int | None:
  """The first position a slot of `config` cannot decode at, or None where nothing ends.

  A cache of max_target_length entries holds positions 0..max_target_length-1.
  A ring shorter than that holds its whole sliding window, needs nothing
  older and decodes on; a window of max_target_length or more is cut to a
  ring of max_target_length, which past it would drop tokens the window still
  sees. Read off the cache tree itself, so one full-length layer among rings
  ends it. A learned position table (trainable_position_size) ends as well.
  """
  lengths = [
      leaf.shape[-1]
      for path, leaf in canonical.flatten(decoding.abstract_cache(config, 1, config.max_target_length)).items()
      if path.endswith("/" + kv_cache.POSITIONS)
  ]
  limits = [config.max_target_length] if max(lengths) >= config.max_target_length else []
  if config.trainable_position_size:
    limits.append(config.trainable_position_size)
  return min(limits, default=None)


def limit_text(config: Config, limit: int) -> str:
  if config.trainable_position_size == limit:
    return f"trainable_position_size={limit}, the positions this model has learned, ends there"
  return f"its cache holds max_target_length={limit} tokens{window_note(config)}"


def window_note(config: Config) -> str:
  window = kv_cache.window(config)
  return f", a ring of its sliding_window_size={window}" if window else ""
