"""Linen <-> NNX wrappers: `flax.nnx.bridge`, plus what it lacks for a whole model.

flax's wrappers do the real work; these subclasses change four behaviours:

- `ToNNX` keeps what the Linen module sows. An NNX module's own `sow` always
  records; flax's ToNNX drops Linen intermediates unless a Linen scope above
  it asks for them, so behind a ToNNX they would silently vanish.
- `ToNNX` forgets its `Rngs` after `lazy_init`. flax's draws a key from every
  stream on every call, which mutates an RngCount; under raw `jax.grad` over
  split state that fails ("Cannot mutate RngCount from a different trace
  level"). Our layers are deterministic, so a call needs no key; pass
  `rngs=` explicitly to a call that does.
- `ToLinen` boxes logically sharded NNX variables as `nn.LogicallyPartitioned`.
  flax's `NNXMeta` box ignores `add_axis`, so under `nn.scan` the stacked layer
  axis would lose its "layers" name.
- `ToLinen` refuses to run with parameters missing or unknown. flax's silently
  re-initialises a missing parameter (and only warns on unknown ones), which
  turns a bad checkpoint into a model that quietly trains from noise. It also
  builds the NNX module abstractly (`nnx.eval_shape`) on apply, so the
  throw-away initial values are never computed.
"""

import warnings
from typing import Any, Callable

import flax.linen as nn
import jax
from flax import nnx
from flax.nnx import bridge as flax_bridge
from flax.nnx.bridge import module as bridge_module
from flax.nnx.bridge import variables as bridge_variables
from flax.nnx.bridge import wrappers as bridge_wrappers

from maxbridge.core import canonical

# Shardings are derived once from the abstract state, with the logical axis
# rules (MaxText's way). Eager sharding would instead need a mesh in context
# whenever any Variable with logical names is made, including the ones the
# bridge makes from Linen boxes, so it is off for the whole process.
nnx.use_eager_sharding(False)
# flax 0.12 deprecates sow() outside nnx.capture(), but its own bridge carries
# intermediates as module attributes (ToNNX sets them, ToLinen maps them to the
# "intermediates" collection); capture() would miss any sown behind a ToNNX.
# We keep attribute-style sow so intermediates cross the bridge both ways.
warnings.filterwarnings(
    "ignore", message=r"Using 'Module.sow\(\)' outside of 'nnx.capture\(\)'", category=DeprecationWarning
)


class ToNNX(flax_bridge.ToNNX):
  """A Linen module as an NNX module; deterministic once initialised."""

  def lazy_init(self, *args, **kwargs) -> "ToNNX":
    flax_bridge.lazy_init(self, *args, **kwargs)
    self.to_nnx__rngs = None
    return self

  def __call__(self, *args, mutable: Any = None, **kwargs):
    outside_linen = bridge_wrappers.current_linen_module() is None and bridge_module.current_module() is None
    if mutable is None and outside_linen:
      # "cache": a decode cache (maxbridge.engine) given to the NNX side must
      # reach the Linen layers writable; without one, nothing is written.
      mutable = ["intermediates", "cache"]
    return super().__call__(*args, mutable=mutable, **kwargs)


def to_linen_var(variable: nnx.Variable) -> Any:
  names = variable.get_metadata().get("out_sharding")
  if names is not None:
    return nn.LogicallyPartitioned(variable.get_value(), names=tuple(names))
  return bridge_variables.to_linen_var(variable)


def linen_initializing() -> bool:
  """Whether NNX code runs inside a Linen init (ToLinen's first call), which only declares the parameters."""
  module = bridge_wrappers.current_linen_module()
  return module is not None and module.is_initializing()


class ToLinen(flax_bridge.ToLinen):
  """An NNX module class as a Linen module; strict about the parameters it is given."""

  metadata_fn: Callable[[nnx.Variable], Any] | None = to_linen_var

  @nn.compact
  def __call__(self, *args, nnx_method: Callable[..., Any] | str | None = None, **kwargs):
    if self.is_initializing():
      module = self.nnx_class(*self.args, **self._nnx_kwargs())
    else:
      module = nnx.eval_shape(lambda: self.nnx_class(*self.args, **self._nnx_kwargs()))
      self._load_state(module)
    method = bridge_wrappers._get_module_method(module, nnx_method)  # pylint: disable=protected-access
    out = method(module, *args, **kwargs)
    self._update_variables(module)
    return out

  def _nnx_kwargs(self) -> dict[str, Any]:
    kwargs = dict(self.kwargs)
    if not self.skip_rng:
      rngs = bridge_wrappers.linen_rngs_dict(self, add_default=not self.is_initializing())
      kwargs["rngs"] = nnx.Rngs(**rngs)
    return kwargs

  def _load_state(self, module: nnx.Module) -> None:
    """Fills the abstract `module` from this scope's variables, or raises naming the paths."""
    collections = {name: nn.unbox(tree) for name, tree in self.variables.items()}
    given = canonical.flatten(collections.get("params", {}))
    expected = canonical.flatten(nnx.to_pure_dict(nnx.state(module, nnx.Param)))
    missing = sorted(set(expected) - set(given))
    unknown = sorted(set(given) - set(expected))
    if missing or unknown:
      where = "/".join(self.scope.path) or "<root>"
      lines = [f"  missing: {p} {tuple(expected[p].shape)}" for p in missing]
      lines += [f"  unknown: {p}" for p in unknown]
      raise ValueError(
          f"ToLinen({self.nnx_class.__name__}) at {where!r} was given parameters that do not "
          "match the module (flax would silently re-initialise the missing ones):\n" + "\n".join(lines)
      )
    for name, tree in collections.items():
      # As typed Variables: a collection the module does not declare (a decode
      # cache) is then added as its NNX type (nnx.Cache), not as raw arrays.
      nnx.update(module, nnx.State(jax.tree.map(lambda x, name=name: bridge_variables.to_nnx_var(name, x), tree)))
    leftover = [
        "/".join(map(str, path))
        for path, value in nnx.to_flat_state(nnx.state(module))
        if isinstance(value.get_value(), jax.ShapeDtypeStruct)
    ]
    if leftover:
      raise ValueError(
          f"ToLinen({self.nnx_class.__name__}) cannot rebuild state the Linen variables do not "
          f"hold: {leftover}. Modules wrapped by maxbridge.bridge.ToLinen must not keep Rngs."
      )
