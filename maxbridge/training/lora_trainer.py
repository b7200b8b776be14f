"""The LoRA trainers: adapters trained, the base frozen, on either backend (the math: `maxbridge.models.lora`)."""

import functools
import re
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh

from maxbridge.core import canonical, layouts
from maxbridge.core.config import Config
from maxbridge.models.lora import (
    COLLECTION,
    abstract_adapters,
    adapter_axes,
    dequantize_base,
    drop_adapter_inputs,
    dropout_key,
    init_adapters,
    merge,
    quantize_base,
    stored_axes,
)
from maxbridge.models.model import LinenModel, NNXModel, linen_forward, nnx_forward
from maxbridge.training.trainer import Bound, LinenTrainer, NNXTrainer, Params, int32_disk_step, int32_step


def disk_layout(tx, adapters: Mapping[str, Any]) -> dict:
  """An adapter checkpoint's tree (abstract), the same for both backends."""
  params = {COLLECTION: adapters}
  return {
      "params": params,
      "opt_state": layouts.optax_to_tree(jax.eval_shape(tx.init, params)),
      "step": jax.ShapeDtypeStruct((), jnp.int32),
  }


class LoraTrainState(train_state.TrainState):
  """flax's TrainState over {"lora": adapters}; the base parameters ride along, never updated."""

  base: Any = None  # {"params": canonical base tree}


class _LoraMixin:
  """What both backends' LoRA trainers share: the adapter tree, the merged view, the adapter checkpoint."""

  saves_params = False  # checkpoints hold the adapters only: the base comes from where the run started

  def _setup_adapters(self, config: Config, abstract_params: dict, kernel_axes: dict) -> None:
    self.abstract_adapters = abstract_adapters(config, abstract_params)
    self.adapter_axes = adapter_axes(config, abstract_params, kernel_axes)
    # The base as the state holds it (QLoRA: quantized kernels; otherwise the canonical tree itself).
    self.abstract_stored = jax.eval_shape(functools.partial(quantize_base, config), abstract_params)
    self.stored_axes = stored_axes(config, abstract_params, kernel_axes)

  def _init_adapters(self, seed) -> dict:
    return init_adapters(self.abstract_adapters, seed, self.config)

  @functools.cached_property
  def disk_layout(self) -> dict:
    return disk_layout(self.tx, self.abstract_adapters)

  def _adapted(self, bound: Bound, stored: Params, adapters: Params) -> Params:
    """The canonical parameters a forward pass runs on: the (dequantized) base with the adapters merged in,
    their inputs dropped out in a train step."""
    if bound.training and self.config.lora_dropout:
      adapters = drop_adapter_inputs(self.config, adapters, dropout_key(self.config, bound.step))
    return merge(self.config, dequantize_base(self.config, stored), adapters)

  def _canonical_view(self, bound: Bound, params) -> Params:
    # What losses that read the model directly (vocabulary tiling's head) see: the adapted weights.
    return self._adapted(bound, self._stored(bound), self._canonical(params))

  def params(self, state) -> Params:
    """The canonical base of a state (QLoRA: its dequantized values)."""
    return canonical.unflatten(canonical.flatten(dequantize_base(self.config, self.stored_base(state))))

  def _reference_params(self, bound: Bound, reference: Params):
    # A frozen reference model (DPO's) is the base: the adapters off, as zeros give a zero update.
    del reference
    return jax.tree.map(jnp.zeros_like, bound.params)

  # So the reference needs no copy of the base (a float one, under QLoRA): an empty stand-in is passed.
  _reference_shardings = None

  def set_reference(self, state) -> None:
    del state
    self.reference = {}

  def _reference_arg(self, abstract: bool = False):
    del abstract
    return {} if self.loss.frozen_reference else None

  def adapted_params(self, state) -> Params:
    """The canonical parameters the model runs on: the base with every adapter merged in."""
    bound = self._bind(state)
    return self._canonical_view(bound, bound.params)

  def model_params(self, state) -> Params:
    return self.adapted_params(state)

  def adapters(self, state) -> dict:
    """The canonical adapter tree of a state."""
    return self.to_checkpoint(state)["params"][COLLECTION]


class LinenLoraTrainer(_LoraMixin, LinenTrainer):
  """Linen LoRA: the TrainState's params (and so its optimizer) are {"lora": adapters}; the base is `state.base`."""

  def __init__(self, config: Config, model: LinenModel, mesh: Mesh | None = None, **hooks):
    super().__init__(config, model, mesh, **hooks)
    self._setup_adapters(config, self.abstract_params, model.logical_axes())

  def trainable(self, config: Config) -> str:
    return COLLECTION

  def _create(self, stored: dict, adapters: dict | None = None) -> LoraTrainState:
    return int32_step(
        LoraTrainState.create(
            apply_fn=self.model.apply, params={COLLECTION: adapters}, tx=self.tx, base={"params": stored}
        )
    )

  def abstract_state(self):
    return jax.eval_shape(self._create, self.abstract_stored, self.abstract_adapters)

  def _init(self, seed):
    return self._create(quantize_base(self.config, self._initial_params(seed)), self._init_adapters(seed))

  def logical_specs(self):
    def box(abstract, axes):
      return jax.tree.map(lambda leaf, names: nn.LogicallyPartitioned(leaf, names), abstract, axes)

    base = box(self.abstract_stored, self.stored_axes) if self.config.lora_weight_qtype else self.model.boxed_params()
    boxed = box(self.abstract_adapters, self.adapter_axes)
    return nn.get_partition_spec(jax.eval_shape(self._create, base, boxed))

  def stored_base(self, state) -> dict:
    """The base as the state holds it (QLoRA: `kernel_qvalue` + `kernel_scale` per layer kernel)."""
    return state.base["params"]

  def _replace_params(self, state, params: Params):
    return state.replace(base={**state.base, "params": quantize_base(self.config, params)})

  def with_checkpoint(self, state, tree: dict):
    """`state` (its base) with the adapters, optimizer state and step of an adapter checkpoint."""
    return state.replace(
        params=tree["params"],
        opt_state=layouts.optax_from_tree(state.opt_state, tree["opt_state"]),
        step=jnp.asarray(tree["step"], jnp.int32),
    )

  def _bind(self, state) -> Bound:
    return Bound(params=state.params, frozen=state.base, step=state.step, handle=state)

  def _stored(self, bound: Bound) -> Params:
    return bound.frozen["params"]

  def _canonical(self, params) -> Params:
    return params[COLLECTION]

  def _forward(self, bound, params, frozen, tokens, positions, segment_ids):
    merged = self._adapted(bound, frozen["params"], params[COLLECTION])
    return linen_forward(self.model.module, {**frozen, "params": merged}, tokens, positions, segment_ids)


class Adapters(nnx.Module):
  """A canonical adapter tree as `nnx.LoRAParam`s (or `variable`s), one submodule per path level."""

  def __init__(self, tree: Mapping[str, Any], axes: Mapping[str, Any], variable: type = nnx.LoRAParam):
    for name, value in tree.items():
      if isinstance(value, Mapping):
        setattr(self, name, Adapters(value, axes[name], variable))
      else:
        setattr(self, name, variable(value, out_sharding=tuple(axes[name])))


class LoraTrainStateNNX(nnx.Module):
  """The NNX LoRA train state: the frozen model, its adapters, and an optimizer over the adapters only.

  Under QLoRA `model` is the stored base (`Adapters` of `nnx.Param`s in the
  canonical tree, quantized kernels included): the model's float kernels
  exist only inside a forward pass.
  """

  def __init__(self, model: nnx.Module, adapters: Adapters, optimizer: nnx.Optimizer):
    self.model = model
    self.adapters = adapters
    self.optimizer = optimizer


def _nnx_path(disk_path: str) -> str:
  """An adapter checkpoint's path -> the same leaf's path in `LoraTrainStateNNX`'s pure dict."""
  if disk_path == "step":
    return "optimizer/step"
  if disk_path.startswith("params/lora/"):
    return "adapters/" + disk_path[len("params/lora/") :]
  return "optimizer/" + re.sub(r"/(mu|nu)/lora/", r"/\1/", disk_path)


class NNXLoraTrainer(_LoraMixin, NNXTrainer):
  """NNX LoRA: adapters are `nnx.LoRAParam`s beside the model; `nnx.Optimizer(adapters, wrt=nnx.LoRAParam)`."""

  def __init__(self, config: Config, build_model: Callable[[nnx.Rngs], nnx.Module], mesh: Mesh | None = None, **hooks):
    abstract_model = NNXModel(config, nnx.eval_shape(lambda: build_model(nnx.Rngs(params=0))))
    self.config = config
    self._setup_adapters(config, abstract_model.abstract_params(), abstract_model.logical_axes())
    # QLoRA runs the model from its graph definition and a Param state filled with the merged weights.
    self._model_graphdef, self._model_params, rest = nnx.split(abstract_model.module, nnx.Param, ...)
    if config.lora_weight_qtype and jax.tree.leaves(rest):
      raise ValueError(
          f"lora_weight_qtype={config.lora_weight_qtype!r}: QLoRA stores the base outside the model, whose state "
          f"must be its parameters only; this model also holds {sorted(nnx.to_pure_dict(rest))}"
      )
    super().__init__(config, build_model, mesh, **hooks)

  def trainable(self, config: Config) -> nnx.filterlib.Filter:
    return nnx.LoRAParam

  def _create(self, seed) -> LoraTrainStateNNX:
    if self.config.lora_weight_qtype:
      model = Adapters(quantize_base(self.config, self._initial_params(seed)), self.stored_axes, nnx.Param)
    else:
      model = self.build_model(nnx.Rngs(params=0))
      nnx.update(model, self._initial_params(seed))
    adapters = Adapters(self._init_adapters(seed), self.adapter_axes)
    return LoraTrainStateNNX(model, adapters, nnx.Optimizer(adapters, self.tx, wrt=nnx.LoRAParam))

  def to_checkpoint(self, state) -> dict:
    flat = {layouts.keypath_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]}
    tree = jax.tree_util.tree_map_with_path(lambda path, _: flat[_nnx_path(layouts.keypath_str(path))], self.disk_layout)
    return int32_disk_step(tree)

  def with_checkpoint(self, state, tree: dict):
    pure: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      *parents, name = _nnx_path(layouts.keypath_str(path)).split("/")
      node = pure
      for key in parents:
        node = node.setdefault(int(key) if key.isdigit() else key, {})
      node[name] = leaf
    pure["optimizer"]["step"] = jnp.asarray(pure["optimizer"]["step"], jnp.uint32)
    state = jax.tree.map(lambda x: x, state)  # a fresh State: the caller's stays as it was
    nnx.replace_by_pure_dict(state, pure)
    return state

  def _bind(self, state) -> Bound:
    # No copy, as in NNXTrainer._bind: the optimizer update writes into these Variables and is read back from them.
    opened = nnx.merge(self.graphdef, state)
    model_graphdef, base, rest = nnx.split(opened.model, nnx.Param, ...)
    if self.config.lora_weight_qtype:  # `opened.model` is the stored base, not the model
      model_graphdef = self._model_graphdef
    _, adapters = nnx.split(opened.adapters, nnx.LoRAParam)
    return Bound(params=adapters, frozen=(base, rest), step=opened.optimizer.step[...], handle=(opened, model_graphdef))

  def _stored(self, bound: Bound) -> Params:
    return nnx.to_pure_dict(bound.frozen[0])

  def stored_base(self, state) -> dict:
    """The base as the state holds it (QLoRA: `kernel_qvalue` + `kernel_scale` per layer kernel)."""
    return canonical.unflatten(canonical.flatten(nnx.to_pure_dict(state)["model"]))

  def _replace_params(self, state, params: Params):
    return super()._replace_params(state, quantize_base(self.config, params))

  def _forward(self, bound, params, frozen, tokens, positions, segment_ids):
    _, model_graphdef = bound.handle
    base, rest = frozen
    merged = self._adapted(bound, nnx.to_pure_dict(base), nnx.to_pure_dict(params))
    if self.config.lora_weight_qtype:  # the model's Param state; `rest` is empty (checked in __init__)
      base = self._model_params
    base = jax.tree.map(lambda x: x, base)  # a fresh State to fill: `frozen` is read by every micro-batch
    nnx.replace_by_pure_dict(base, merged)
    return nnx_forward(model_graphdef, base, rest, tokens, positions, segment_ids)

  def _apply_update(self, bound, grads):
    opened, _ = bound.handle
    opened.optimizer.update(opened.adapters, grads)
    return nnx.state(opened, nnx.Not(nnx.Intermediate))
