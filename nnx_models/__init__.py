"""Flax NNX decoder families. Mirrors linen_models/ file for file."""

import functools

import jax
from flax import nnx

# The process-wide NNX settings every model here relies on (no eager sharding,
# attribute-style sow) live in maxbridge.core.bridge; importing a model sets them.
from maxbridge.core import bridge as _bridge  # noqa: F401, E402


class Module(nnx.Module):
  """An `nnx.Module` whose calls run under `jax.named_scope` of its class, so that a profile reads by module.

  Linen names every module call itself (Flax's `flax_profile`, on by default, by module name); NNX names
  none. Here each call is named by its class (`Decoder/DecoderLayer/Attention/dot_product_attention`).
  """

  def __init_subclass__(cls, **kwargs):
    super().__init_subclass__(**kwargs)
    call = cls.__dict__.get("__call__")
    if call is None:
      return

    @functools.wraps(call)
    def named(self, *args, **kwargs):
      with jax.named_scope(cls.__name__):
        return call(self, *args, **kwargs)

    cls.__call__ = named
