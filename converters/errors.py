"""The one error type of the converters: a request that cannot be done, and why."""


class ConversionError(ValueError):
  """A checkpoint that cannot be read, converted or written as asked; the message names the path."""
