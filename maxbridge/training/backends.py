"""The two train state backends behind `Trainer`'s hooks: Linen's `TrainState` and NNX's `TrainStateNNX`.

Each holds the policy's trees (`maxbridge.training.trainable`) its own way and
maps them to the one checkpoint tree; the step, the parameters' faces and the
checkpoint plumbing are `Trainer`'s (`maxbridge.training.trainer`).
"""

from typing import Any, Callable, Mapping, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh

from maxbridge.core import layouts
from maxbridge.core.config import Config
from maxbridge.models.model import LinenModel, NNXModel, linen_forward, nnx_forward
from maxbridge.training.trainer import Bound, Params, Trainer


def int32_step(state: train_state.TrainState) -> train_state.TrainState:
  """`state` with its step an int32 0, as a restored state has it.

  `TrainState.create` starts from a Python 0, weakly typed under jit: a fresh
  and a resumed state would each compile a train step of their own.
  """
  return state.replace(step=jnp.zeros((), jnp.int32))


def _boxed(abstract: Params | None, axes: Params | None):
  """Abstract leaves in Linen logical-partitioning boxes, by their axis names."""
  if abstract is None:
    return None
  return jax.tree.map(lambda leaf, names: nn.LogicallyPartitioned(leaf, names), abstract, axes)


class LinenTrainState(train_state.TrainState):
  """flax's TrainState over {collection: the trained tree}; a frozen tree (LoRA's base) rides along in `stored`."""

  stored: Any = None


class LinenTrainer(Trainer):

  def __init__(self, config: Config, model: LinenModel, mesh: Mesh | None = None, **hooks):
    self.model = model
    super().__init__(config, model.abstract_params(), model.logical_axes(), mesh, **hooks)

  def _new_state(self, trained, stored) -> LinenTrainState:
    params = {self.trainable.collection: trained}
    return int32_step(LinenTrainState.create(apply_fn=self.model.apply, params=params, tx=self.tx, stored=stored))

  def logical_specs(self):
    # Linen's logical boxes ride through optax: mu and nu come out boxed too.
    t = self.trainable
    trained, stored = _boxed(t.abstract_trained, t.trained_axes), _boxed(t.abstract_stored, t.stored_axes)
    state = jax.eval_shape(self._new_state, trained, stored)
    # A box around no array (optax's MaskedNode: a partitioned optimizer such as Muon keeps no state of that
    # kind for the leaf) is no leaf of the state, so it takes no spec.
    state = jax.tree.map(
        lambda x: x.value if isinstance(x, nn.LogicallyPartitioned) and not jax.tree.leaves(x.value) else x,
        state,
        is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned),
    )
    return nn.get_partition_spec(state)

  def _bind(self, state) -> Bound:
    trained = state.params[self.trainable.collection]
    return Bound(params=trained, frozen=None, stored=state.stored, step=state.step, handle=state)

  def _run(self, bound, params, frozen, tokens, positions, segment_ids):
    return linen_forward(self.model.module, {"params": params}, tokens, positions, segment_ids)

  def _apply_update(self, bound, grads):
    return bound.handle.apply_gradients(grads={self.trainable.collection: grads})

  def _tree(self, state) -> dict:
    tree = {"params": state.params, "opt_state": layouts.optax_to_tree(state.opt_state), "step": state.step}
    if self.trainable.abstract_stored is not None:
      tree["stored"] = state.stored
    return tree

  def _with_tree(self, state, tree):
    parts = {key: tree[key] for key in ("params", "stored") if key in tree}
    if "opt_state" in tree:
      parts["opt_state"] = layouts.optax_from_tree(state.opt_state, tree["opt_state"])
    if "step" in tree:
      parts["step"] = jnp.asarray(tree["step"], jnp.int32)
    return state.replace(**parts)


class TrainStateNNX(nnx.Module):
  """The NNX train state: the model and its optimizer (which holds the step).

  A policy that trains a tree of its own (LoRA's adapters, as `nnx.LoRAParam`s)
  keeps it beside the frozen model as `adapters`, the optimizer's alone; under
  QLoRA `model` is the stored base (a `Tree` of `nnx.Param`s in the canonical
  tree, quantized kernels included): the model's float kernels exist only
  inside a forward pass.
  """

  def __init__(self, model: nnx.Module, optimizer: nnx.Optimizer, adapters: nnx.Module | None = None):
    self.model = model
    if adapters is not None:
      self.adapters = adapters
    self.optimizer = optimizer


class Tree(nnx.Module):
  """A canonical tree as `variable`s, one submodule per path level, each with its logical axes."""

  def __init__(self, tree: Mapping[str, Any], axes: Mapping[str, Any], variable: type):
    for name, value in tree.items():
      if isinstance(value, Mapping):
        setattr(self, name, Tree(value, axes[name], variable))
      else:
        setattr(self, name, variable(value, out_sharding=tuple(axes[name])))


class _Opened(NamedTuple):
  """An NNX state opened for one step (`Bound.handle`)."""

  state: TrainStateNNX  # merged: its optimizer steps in `_apply_update`
  graphdef: nnx.GraphDef  # the model's
  model_params: nnx.State  # the model's Param state, which `_run` fills with the canonical view
  trained: nnx.State  # the Variables the optimizer trains


class NNXTrainer(Trainer):
  """NNX train state, stepped by `jax.jit` over split state with the graph definition static.

  `nnx.jit` would re-traverse the object graph on every call, which costs
  several times the step itself on small models; a static GraphDef does not.
  The state between steps is pure (`nnx.as_pure`: arrays, no `nnx.Variable`s):
  `jax.jit` flattens its input and builds its output on every call, and a
  Variable per leaf is Python work each time. On qwen3-next-tiny (213 leaves,
  one 16-token row, idle 2-core CPU) the call's host time was 4.0 ms with
  Variables, 2.1 ms pure and 1.8 ms for Linen's state; the step 1.10x Linen's
  time, then 1.02x. The step merges it with the GraphDef, which restores the
  Variables' types.
  """

  def __init__(self, config: Config, build_model: Callable[[nnx.Rngs], nnx.Module], mesh: Mesh | None = None, **hooks):
    self.build_model = build_model
    abstract_model = NNXModel(config, nnx.eval_shape(lambda: build_model(nnx.Rngs(params=0))))
    super().__init__(config, abstract_model.abstract_params(), abstract_model.logical_axes(), mesh, **hooks)
    # A stored tree the model cannot hold (QLoRA's) runs the model from its graph definition and a Param state.
    self._model_graphdef, self._model_params, rest = nnx.split(abstract_model.module, nnx.Param, ...)
    if self.trainable.stored_outside_model and jax.tree.leaves(rest):
      raise ValueError(
          f"{self.trainable.stored_outside_model}, whose state must be its parameters only; this model also "
          f"holds {sorted(nnx.to_pure_dict(rest))}"
      )
    # From the abstract trees, as Linen's `abstract_state`: tracing the initializers would cost most of the build.
    self.graphdef, self._abstract_variables = nnx.split(
        nnx.eval_shape(self._module, self.trainable.abstract_trained, self.trainable.abstract_stored)
    )
    self._abstract_state = nnx.as_pure(self._abstract_variables)
    self._layout = {**self.disk_layout, "stored": self.trainable.abstract_stored}

  def _model(self, params: Params) -> nnx.Module:
    # Built inside jit or eval_shape only: the module's own random initial
    # values are dead code once the canonical ones are written over them.
    model = self.build_model(nnx.Rngs(params=0))
    nnx.update(model, params)
    return model

  def _module(self, trained, stored) -> TrainStateNNX:
    t = self.trainable
    if t.trains_model:
      model = self._model(trained)
      return TrainStateNNX(model, nnx.Optimizer(model, self.tx, wrt=nnx.Param))
    model = Tree(stored, t.stored_axes, nnx.Param) if t.stored_outside_model else self._model(stored)
    adapters = Tree(trained, t.trained_axes, nnx.LoRAParam)
    return TrainStateNNX(model, nnx.Optimizer(adapters, self.tx, wrt=nnx.LoRAParam), adapters)

  def _new_state(self, trained, stored):
    return nnx.as_pure(nnx.state(self._module(trained, stored)))

  def abstract_state(self):
    return self._abstract_state

  def logical_specs(self):
    # nnx.Optimizer copies each parameter's metadata onto its mu and nu. A Variable holding no array (optax's
    # MaskedNode: a partitioned optimizer such as Muon keeps no state of that kind for the leaf) takes no spec.
    return nnx.as_pure(
        jax.tree.map(
            lambda spec, variable: variable if not jax.tree.leaves(variable) else spec,
            nnx.get_partition_spec(self._abstract_variables),
            self._abstract_variables,
            is_leaf=lambda x: isinstance(x, nnx.Variable),
        )
    )

  def _bind(self, state) -> Bound:
    # No copy: `state` is this trace's own input, and the optimizer update
    # must write into exactly these Variables for `_apply_update` to read back.
    opened = nnx.merge(self.graphdef, state)
    graphdef, model_params, rest = nnx.split(opened.model, nnx.Param, ...)
    trained, stored = model_params, None
    if not self.trainable.trains_model:
      _, trained = nnx.split(opened.adapters, nnx.LoRAParam)
      stored = nnx.to_pure_dict(model_params)
      if self.trainable.stored_outside_model:  # `opened.model` is the stored tree, not the model; `rest` is empty
        graphdef, model_params = self._model_graphdef, self._model_params
    handle = _Opened(opened, graphdef, model_params, trained)
    return Bound(nnx.to_pure_dict(trained), rest, stored, opened.optimizer.step[...], handle)

  def _run(self, bound, params, frozen, tokens, positions, segment_ids):
    filled = jax.tree.map(lambda x: x, bound.handle.model_params)  # a fresh State: the bound one serves every pass
    nnx.replace_by_pure_dict(filled, params)
    return nnx_forward(bound.handle.graphdef, filled, frozen, tokens, positions, segment_ids)

  def _apply_update(self, bound, grads):
    opened = bound.handle.state
    grads_state = jax.tree.map(lambda x: x, bound.handle.trained)  # the optimizer takes the Variables' gradients
    nnx.replace_by_pure_dict(grads_state, grads)
    opened.optimizer.update(opened.model if self.trainable.trains_model else opened.adapters, grads_state)
    # Sown intermediates would make the output tree differ from the input
    # (and break donation); they are never state.
    return nnx.as_pure(nnx.state(opened, nnx.Not(nnx.Intermediate)))

  def _state_path(self, path: str) -> str:
    """A path of `_tree`'s tree -> the same leaf's path in the state's pure dict (`layouts.layout_path`'s mapping,
    for any collection)."""
    parts, collection = path.split("/"), self.trainable.collection
    if parts[0] == "stored":
      return "/".join(["model", *parts[1:]])
    if parts[:2] == ["params", collection]:
      return "/".join(["model" if self.trainable.trains_model else "adapters", *parts[2:]])
    if parts == ["step"]:
      return "optimizer/step"
    # NNX keeps no collection level above an optimizer leaf shaped like the trained tree (Adam's mu and nu).
    level = lambda i: parts[i] == collection and i >= 3 and collection not in parts[2:i]  # noqa: E731
    return "/".join(["optimizer", *[part for i, part in enumerate(parts) if not level(i)]])

  def _tree(self, state) -> dict:
    flat = {layouts.keypath_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]}
    return jax.tree_util.tree_map_with_path(lambda p, _: flat[self._state_path(layouts.keypath_str(p))], self._layout)

  def _with_tree(self, state, tree):
    pure: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      *parents, name = self._state_path(layouts.keypath_str(path)).split("/")
      node = pure
      for key in parents:
        node = node.setdefault(int(key) if key.isdigit() else key, {})
      node[name] = leaf
    if "step" in tree:  # NNX's optimizer counts in uint32
      pure["optimizer"]["step"] = jnp.asarray(pure["optimizer"]["step"], jnp.uint32)
    state = jax.tree.map(lambda x: x, state)  # a fresh State: the caller's stays as it was
    nnx.replace_by_pure_dict(state, pure)
    return state
