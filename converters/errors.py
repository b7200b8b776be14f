"""The converters' error: a request that cannot be done, and why."""

from maxbridge.core.checkpointing import CheckpointError


class ConversionError(CheckpointError):
  """A checkpoint that cannot be converted or written as asked; the message names the path.

  A kind of `maxbridge.core.checkpointing.CheckpointError`, which reading a
  checkpoint raises: catch that one for any checkpoint that cannot be used.
  """
