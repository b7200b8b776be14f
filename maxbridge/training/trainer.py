"""Train state and the one train step, for both backends.

`Trainer` owns the step: loss -> gradient accumulation -> clipping -> metrics
-> update -> after-update hook. A backend supplies three hooks: `trainable`
and `_bind` (what is trained, and the state opened for one step), `_forward`
(logits and intermediates) and `_apply_update`.

Linen: flax's `TrainState`, its params under a {"params": ...} collection level
as MaxText keeps them. NNX: `TrainStateNNX(model, optimizer)`; the step lives
in the `nnx.Optimizer`. Both speak the same on-disk layout (MaxText's):

    {"params": {"params": <canonical tree>},
     "opt_state": [{"count", "mu": {"params": ...}, "nu": {"params": ...}}, None, {"count"}],
     "step": int32}

`maxbridge.training.recipe.create_trainer` picks the backend and the loss; nothing
else here reads a flag.
"""

import abc
import functools
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import flax.linen as nn
import optax
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding

from maxbridge.core import canonical, initializers, layouts, sharding
from maxbridge.training import optimizers
from maxbridge.ops import quantization
from maxbridge.core.config import Config
from maxbridge.training.loss import Forward, Loss
from maxbridge.models.model import LinenModel, linen_forward, nnx_forward

Batch = Mapping[str, jax.Array]
Params = dict[str, Any]
# (canonical parameters after the update, this step's metrics) -> canonical parameters.
AfterUpdate = Callable[[Params, dict], Params]


class TrainStateNNX(nnx.Module):
  """The NNX train state: the model and its optimizer (which holds the step)."""

  def __init__(self, model: nnx.Module, optimizer: nnx.Optimizer):
    self.model = model
    self.optimizer = optimizer


class Bound(NamedTuple):
  """A train state opened for one step by a backend's `_bind`."""

  params: Any  # what the step differentiates: the parameters the `trainable` filter selects
  frozen: Any  # what the forward pass also reads, never differentiated
  step: jax.Array  # the optimizer step this update makes (it sets the learning rate)
  handle: Any  # the backend's own, for `_forward` and `_apply_update`
  training: bool = False  # a train step's (randomness such as LoRA's dropout applies), not an eval step's


def accumulate_gradients(value_and_grad: Callable, params: Any, batch: Batch, num_micro: int):
  """Mean loss and gradient over all tokens of `batch`, in `num_micro` sequential micro-batches.

  `value_and_grad` returns ((sum, aux), grads) with `aux["tokens"]` the
  count to divide by; every other aux entry is reported per token as well,
  but `aux["maxima"]` (per-layer maxima), which is the maximum over micro-batches.
  """
  if num_micro == 1:
    (loss_sum, aux), grads = value_and_grad(params, batch)
  else:
    micro = jax.tree.map(lambda x: x.reshape(num_micro, x.shape[0] // num_micro, *x.shape[1:]), batch)

    def add(total, micro_batch):
      result = value_and_grad(params, micro_batch)
      summed = jax.tree.map(jnp.add, total, result)
      if "maxima" in aux_of(result):  # per-layer statistics (QK-Clip's max logits) reduce by max, not sum
        aux_of(summed)["maxima"] = jax.tree.map(jnp.maximum, aux_of(total)["maxima"], aux_of(result)["maxima"])
      return summed, None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(value_and_grad, params, jax.tree.map(lambda x: x[0], micro)))
    if "maxima" in aux_of(zeros):
      aux_of(zeros)["maxima"] = jax.tree.map(lambda x: jnp.full_like(x, -jnp.inf), aux_of(zeros)["maxima"])
    ((loss_sum, aux), grads), _ = jax.lax.scan(add, zeros, micro)
  tokens = jnp.maximum(aux["tokens"], 1.0)
  grads = jax.tree.map(lambda g: g / tokens, grads)
  per_token = {key: value / tokens for key, value in aux.items() if key not in ("tokens", "maxima")}
  metrics = {"loss": loss_sum / tokens, **per_token, "tokens": aux["tokens"]}
  if "maxima" in aux:
    metrics["maxima"] = aux["maxima"]
  return grads, metrics


def aux_of(result) -> dict:
  """The aux dict of a ((loss, aux), grads) result."""
  return result[0][1]


def clip_gradients(grads: Any, threshold: float):
  """Global-norm clipping outside the optimizer (MaxText's way), and the raw norm."""
  norm = optax.tree.norm(grads)
  if threshold > 0:
    grads, _ = optax.clip_by_global_norm(threshold).update(grads, optax.EmptyState())
  return grads, norm


class Trainer(abc.ABC):
  """The train step, written once; `train.py` drives either backend the same way.

  The state lives on `mesh`, each leaf sharded by its logical axes through
  the config's `logical_axis_rules`; batches are split on the batch axes.
  `loss` is what the step minimises; `after_update`, if given, maps the
  canonical parameters after each update (QK-Clip), the same on both backends.
  """

  # Whether checkpoints hold the parameters (LoRA's hold the adapters only, see maxbridge/lora.py).
  saves_params = True

  def __init__(
      self,
      config: Config,
      abstract_params: dict,
      mesh: Mesh | None = None,
      *,
      loss: Loss,
      after_update: AfterUpdate | None = None,
  ):
    self.config = config
    self.mesh = sharding.create_mesh(config) if mesh is None else mesh
    self.rules = config.logical_axis_rules
    self.tx = optimizers.adamw(config)
    self.schedule = optimizers.learning_rate_schedule(config)
    self.abstract_params = abstract_params
    self.loss = loss
    self.after_update = after_update
    self.wrt = self.trainable(config)
    # The frozen reference (canonical parameters) a `frozen_reference` loss reads; see set_reference.
    self.reference: Params | None = None

  def _initial_params(self, seed) -> dict:
    return initializers.init_params(self.abstract_params, seed, initializers.InitOptions.from_config(self.config))

  @functools.cached_property
  def state_shardings(self) -> Any:
    return sharding.spec_tree_to_shardings(self.logical_specs(), self.mesh, self.rules)

  @functools.cached_property
  def batch_sharding(self) -> NamedSharding:
    return sharding.named_sharding(self.mesh, ("activation_batch", "activation_length"), self.rules)

  @functools.cached_property
  def _reference_shardings(self) -> Any:
    return self.params(self.state_shardings) if self.loss.frozen_reference else None

  @functools.cached_property
  def _jitted_train_step(self):
    return jax.jit(
        self._train_step,
        in_shardings=(self.state_shardings, self.batch_sharding, self._reference_shardings),
        out_shardings=(self.state_shardings, None),
        donate_argnums=0,
    )

  @functools.cached_property
  def _jitted_eval_step(self):
    return jax.jit(self._eval_step, in_shardings=(self.state_shardings, self.batch_sharding, self._reference_shardings))

  def set_reference(self, state) -> None:
    """Holds a copy of `state`'s parameters as the frozen reference of a `frozen_reference` loss (DPO).

    `train()` sets it from the run's initial state, also on resume, so a
    checkpoint holds the policy only. Full fine-tuning keeps this second copy;
    a LoRA trainer needs none: its `_reference_params` is the base with the
    adapters off.
    """
    with sharding.active(self.mesh, self.rules):
      self.reference = self._jitted_params(state)

  @functools.cached_property
  def _jitted_params(self):
    return jax.jit(self.params, out_shardings=self._reference_shardings)

  def _reference_arg(self, abstract: bool = False):
    if not self.loss.frozen_reference:
      return None
    if self.reference is None:
      if abstract:  # ahead-of-time lowering needs shapes only
        return jax.tree.map(
            lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
            self.abstract_params,
            self._reference_shardings,
        )
      raise ValueError(
          f"{type(self.loss).__name__} needs a reference model (the frozen starting policy): call "
          "trainer.set_reference(state) with the state training starts from (maxbridge.train does)"
      )
    return self.reference

  def train_step(self, state, batch: Batch):
    """(state, global batch) -> (new state, metrics); `state` is donated."""
    with sharding.active(self.mesh, self.rules):
      return self._jitted_train_step(state, self.loss_batch(batch), self._reference_arg())

  def lower_train_step(self, state, batch: Batch):
    """The train step lowered for (possibly abstract, sharded) inputs: `.compile()` it."""
    with sharding.active(self.mesh, self.rules):
      return self._jitted_train_step.lower(state, self.loss_batch(batch), self._reference_arg(abstract=True))

  def compile_train_step(self, state, batch: Batch):
    """(the compiled step, `step(state) -> (state, metrics)` running it on `batch`).

    One compile serves both XLA's analyses of the executable and timed steps.
    """
    compiled = self.lower_train_step(state, batch).compile()
    args = (self.loss_batch(batch), self._reference_arg())

    def step(state):
      with sharding.active(self.mesh, self.rules):
        return compiled(state, *args)

    return compiled, step

  def eval_step(self, state, batch: Batch) -> dict:
    with sharding.active(self.mesh, self.rules):
      return self._jitted_eval_step(state, self.loss_batch(batch), self._reference_arg())

  def init_state(self, seed: int):
    """The initial state, created directly in its shardings (never whole on one device)."""
    with sharding.active(self.mesh, self.rules):
      return jax.jit(self._init, out_shardings=self.state_shardings)(seed)

  def loss_batch(self, batch: Mapping[str, Any]) -> dict:
    """The entries of `batch` the loss declares (others are never sent to a device); names any missing."""
    missing = [key for key in self.loss.batch_keys if key not in batch]
    if missing:
      raise KeyError(
          f"{type(self.loss).__name__} needs batch keys {list(self.loss.batch_keys)}; the batch lacks "
          f"{missing} (it has {sorted(batch)})"
      )
    return {key: batch[key] for key in self.loss.batch_keys}

  def shard_batch(self, local_batch: Mapping[str, Any]) -> dict:
    """This process's rows -> global arrays split over the mesh's batch axes."""
    local_batch = self.loss_batch(local_batch)
    rows = next(iter(local_batch.values())).shape[0] * jax.process_count()
    return {
        key: jax.make_array_from_process_local_data(self.batch_sharding, value, (rows, *value.shape[1:]))
        for key, value in local_batch.items()
    }

  @functools.cached_property
  def disk_layout(self) -> dict:
    """The on-disk tree, abstract (shapes and dtypes): the same for both backends."""
    params = {"params": self.abstract_params}
    return {
        "params": params,
        "opt_state": layouts.optax_to_tree(jax.eval_shape(self.tx.init, params)),
        "step": jax.ShapeDtypeStruct((), jnp.int32),
    }

  def checkpoint_target(self) -> dict:
    """`disk_layout`, each leaf sharded as the state is on this mesh: what restore fills."""
    return jax.tree.map(
        lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
        self.disk_layout,
        self.to_checkpoint(self.state_shardings),
    )

  # --- the step, written once ---------------------------------------------

  def _loss(self, bound: Bound, params, batch: Batch, reference: Params | None = None):
    apply = functools.partial(self._forward, bound)
    # The reference pass reads the parameters the step started from, or the
    # frozen `reference`: a constant of the differentiation either way, so no
    # gradient flows through it.
    view = functools.partial(self._canonical_view, bound)
    forward = None
    if self.loss.needs_reference:
      fixed = bound.params if reference is None else self._reference_params(bound, reference)
      forward = Forward(apply, jax.lax.stop_gradient(fixed), bound.frozen, view)
    return self.loss(Forward(apply, params, bound.frozen, view), batch, forward)

  def _canonical_view(self, bound: Bound, params) -> Params:
    """The model's canonical parameters when `params` are trained (LoRA: the base with the adapters merged in)."""
    del bound
    return self._canonical(params)

  def _train_step(self, state, batch: Batch, reference: Params | None = None):
    bound = self._bind(state)._replace(training=True)
    value_and_grad = jax.value_and_grad(functools.partial(self._loss, bound, reference=reference), has_aux=True)
    with quantization.stochastic_rounding(self.config, bound.step):
      grads, metrics = accumulate_gradients(value_and_grad, bound.params, batch, self.config.gradient_accumulation_steps)
    grads, grad_norm = clip_gradients(grads, self.config.gradient_clipping_threshold)
    metrics = {**metrics, "grad_norm": grad_norm, "lr": self.schedule(bound.step)}
    state = self._apply_update(bound, grads)
    if self.after_update is not None:
      state = self._replace_params(state, self.after_update(self.params(state), metrics))
    return state, metrics

  def _eval_step(self, state, batch: Batch, reference: Params | None = None):
    bound = self._bind(state)
    loss_sum, aux = self._loss(bound, bound.params, batch, reference)
    return {"loss": loss_sum / jnp.maximum(aux["tokens"], 1.0), "tokens": aux["tokens"]}

  # --- backend hooks ---------------------------------------------------------

  @abc.abstractmethod
  def trainable(self, config: Config) -> Any:
    """The backend's filter for the parameters the optimizer trains (LoRA: the adapters only)."""

  @abc.abstractmethod
  def _bind(self, state) -> Bound:
    """Opens `state` for one step, split by `trainable` into trained params and the frozen rest."""

  @abc.abstractmethod
  def _forward(self, bound: Bound, params, frozen, tokens, positions, segment_ids):
    """(logits, flat intermediates) for `params` and `frozen` in place of `bound`'s."""

  @abc.abstractmethod
  def _canonical(self, params) -> Params:
    """The trained parameters (`Bound.params`' form) as a canonical tree, traceably."""

  @abc.abstractmethod
  def _reference_params(self, bound: Bound, reference: Params) -> Any:
    """The canonical `reference` in `bound.params`' form, for the reference pass (LoRA: the adapters off)."""

  @abc.abstractmethod
  def _apply_update(self, bound: Bound, grads) -> Any:
    """The new state: the optimizer applied to `grads` (the tree of `bound.params`)."""

  # --- the state's other faces -----------------------------------------------

  @abc.abstractmethod
  def abstract_state(self) -> Any:
    ...

  @abc.abstractmethod
  def _init(self, seed) -> Any:
    """The initial state as a traceable function of the seed."""

  @abc.abstractmethod
  def logical_specs(self) -> Any:
    """The state's tree with a logical PartitionSpec per leaf, from the backend's metadata."""

  @abc.abstractmethod
  def params(self, state) -> dict:
    """Canonical parameters of a state (traceable)."""

  def model_params(self, state) -> dict:
    """The canonical parameters the model runs on, to sample or serve from (LoRA: the adapters merged in)."""
    return self.params(state)

  @abc.abstractmethod
  def _replace_params(self, state, params: Params) -> Any:
    """`state` with its canonical parameters replaced (traceable); the optimizer state is kept."""

  @abc.abstractmethod
  def step(self, state) -> int:
    ...

  @abc.abstractmethod
  def to_checkpoint(self, state) -> dict:
    ...

  @abc.abstractmethod
  def from_checkpoint(self, tree: dict) -> Any:
    ...


def int32_step(state: train_state.TrainState) -> train_state.TrainState:
  """`state` with its step an int32 0, as a restored state has it.

  `TrainState.create` starts from a Python 0, weakly typed under jit: a fresh
  and a resumed state would each compile a train step of their own.
  """
  return state.replace(step=jnp.zeros((), jnp.int32))


class LinenTrainer(Trainer):

  def __init__(self, config: Config, model: LinenModel, mesh: Mesh | None = None, **hooks):
    self.model = model
    super().__init__(config, model.abstract_params(), mesh, **hooks)

  def trainable(self, config: Config) -> str:
    # A Linen collection. A narrower choice (LoRA adapters in a collection of
    # their own) also builds the TrainState's `tx` over that collection only.
    return "params"

  def _create(self, params: dict) -> train_state.TrainState:
    state = train_state.TrainState.create(apply_fn=self.model.apply, params={"params": params}, tx=self.tx)
    return int32_step(state)

  def abstract_state(self):
    return jax.eval_shape(self._create, self.abstract_params)

  def _init(self, seed):
    return self._create(self._initial_params(seed))

  def logical_specs(self):
    # Linen's logical boxes ride through optax: mu and nu come out boxed too.
    return nn.get_partition_spec(jax.eval_shape(self._create, self.model.boxed_params()))

  def params(self, state) -> dict:
    return canonical.unflatten(canonical.flatten(state.params["params"]))

  def _replace_params(self, state, params: Params):
    return state.replace(params={**state.params, "params": params})

  def step(self, state) -> int:
    return int(state.step)

  def to_checkpoint(self, state) -> dict:
    return {"params": state.params, "opt_state": layouts.optax_to_tree(state.opt_state), "step": state.step}

  def from_checkpoint(self, tree: dict):
    template = self.abstract_state()
    return template.replace(
        params=tree["params"],
        opt_state=layouts.optax_from_tree(template.opt_state, tree["opt_state"]),
        step=jnp.asarray(tree["step"], jnp.int32),
    )

  def _bind(self, state) -> Bound:
    trained = {self.wrt: state.params[self.wrt]}
    frozen = {name: value for name, value in state.params.items() if name != self.wrt}
    return Bound(params=trained, frozen=frozen, step=state.step, handle=state)

  def _canonical(self, params) -> Params:
    return params[self.wrt]

  def _reference_params(self, bound, reference):
    return {self.wrt: reference}

  def _forward(self, bound, params, frozen, tokens, positions, segment_ids):
    return linen_forward(self.model.module, {**frozen, **params}, tokens, positions, segment_ids)

  def _apply_update(self, bound, grads):
    return bound.handle.apply_gradients(grads=grads)


class NNXTrainer(Trainer):
  """NNX train state, stepped by `jax.jit` over split state with the graph definition static.

  `nnx.jit` would re-traverse the object graph on every call, which costs
  several times the step itself on small models; a static GraphDef does not.
  """

  def __init__(self, config: Config, build_model: Callable[[nnx.Rngs], nnx.Module], mesh: Mesh | None = None, **hooks):
    self.build_model = build_model
    abstract_model = nnx.eval_shape(lambda: build_model(nnx.Rngs(params=0)))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
        nnx.to_pure_dict(nnx.state(abstract_model, nnx.Param)),
    )
    super().__init__(config, canonical.unflatten(canonical.flatten(abstract)), mesh, **hooks)
    self.graphdef, self._abstract_state = nnx.split(nnx.eval_shape(lambda: self._create(0)))

  def trainable(self, config: Config) -> nnx.filterlib.Filter:
    return nnx.Param

  def _create(self, seed) -> TrainStateNNX:
    # Built inside jit or eval_shape only: the module's own random initial
    # values are dead code once the canonical ones are written over them.
    model = self.build_model(nnx.Rngs(params=0))
    nnx.update(model, self._initial_params(seed))
    return TrainStateNNX(model, nnx.Optimizer(model, self.tx, wrt=self.wrt))

  def abstract_state(self):
    return self._abstract_state

  def _init(self, seed):
    return nnx.state(self._create(seed))

  def logical_specs(self):
    # nnx.Optimizer copies each parameter's metadata onto its mu and nu.
    return nnx.get_partition_spec(self._abstract_state)

  def params(self, state) -> dict:
    pure = nnx.to_pure_dict(state)["model"]
    return canonical.unflatten(canonical.flatten(pure))

  def _replace_params(self, state, params: Params):
    state = jax.tree.map(lambda x: x, state)  # a fresh State: the caller's stays as it was
    nnx.replace_by_pure_dict(state, {"model": params})
    return state

  def step(self, state) -> int:
    return int(nnx.to_pure_dict(state)["optimizer"]["step"])

  def to_checkpoint(self, state) -> dict:
    tree = layouts.nnx_to_linen(nnx.to_pure_dict(state), self.disk_layout)
    return int32_disk_step(tree)

  def from_checkpoint(self, tree: dict):
    pure = layouts.linen_to_nnx(tree)
    pure["optimizer"]["step"] = jnp.asarray(pure["optimizer"]["step"], jnp.uint32)
    state = jax.tree.map(lambda x: x, self._abstract_state)  # a fresh State to fill
    nnx.replace_by_pure_dict(state, pure)
    return state

  def _bind(self, state) -> Bound:
    # No copy: `state` is this trace's own input, and the optimizer update
    # must write into exactly these Variables for `_apply_update` to read back.
    opened = nnx.merge(self.graphdef, state)
    graphdef, params, rest = nnx.split(opened.model, self.wrt, ...)
    return Bound(params=params, frozen=rest, step=opened.optimizer.step[...], handle=(opened, graphdef))

  def _canonical(self, params) -> Params:
    return nnx.to_pure_dict(params)

  def _reference_params(self, bound, reference):
    params = jax.tree.map(lambda x: x, bound.params)  # a fresh State: the bound one stays the policy
    nnx.replace_by_pure_dict(params, reference)
    return params

  def _forward(self, bound, params, frozen, tokens, positions, segment_ids):
    _, graphdef = bound.handle
    return nnx_forward(graphdef, params, frozen, tokens, positions, segment_ids)

  def _apply_update(self, bound, grads):
    opened, _ = bound.handle
    opened.optimizer.update(opened.model, grads)
    # Sown intermediates would make the output tree differ from the input
    # (and break donation); they are never state.
    return nnx.state(opened, nnx.Not(nnx.Intermediate))


# --- the on-disk step ---------------------------------------------------


def int32_disk_step(tree: dict) -> dict:
  """A checkpoint tree with its step as int32, as Linen's train state holds it (NNX's optimizer counts in uint32).

  The same mapping also carries trees of shardings, whose step has no dtype: left as it is.
  """
  step = tree["step"]
  return {**tree, "step": step.astype(jnp.int32) if hasattr(step, "astype") else step}
