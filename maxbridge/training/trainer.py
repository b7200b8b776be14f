"""Train state and the one train step, for both backends.

`Trainer` owns the step (loss -> gradient accumulation -> clipping -> metrics
-> update -> after-update hook) and every face of the state that both
backends share: its canonical parameters, its checkpoint tree, the frozen
model a loss reads. What trains is a policy (`maxbridge.training.trainable`):
every parameter, or LoRA's adapters on a frozen base. A backend supplies seven
hooks: the state it builds around the policy's trees (`_new_state`) and its
logical specs (`logical_specs`); the state opened for one step, split into
what trains and what is only read (`_bind`); the forward pass on canonical
parameters (`_run`); the update (`_apply_update`); and the state as a tree in
the checkpoint layout and back (`_tree`, `_with_tree`).

The backends (`maxbridge.training.backends`): Linen's flax `TrainState` and
NNX's `TrainStateNNX(model, optimizer)`. Both speak the same on-disk layout
(MaxText's):

    {"params": {"params": <canonical tree>},
     "opt_state": [{"count", "mu": {"params": ...}, "nu": {"params": ...}}, None, {"count"}],
     "step": int32}

(LoRA's: the adapters under {"params": {"lora": ...}}, see `maxbridge.models.lora`).
`maxbridge.training.recipe.create_trainer` picks the backend, the policy and
the loss; nothing here reads a flag. What a loss needs beyond the batch (a
frozen model it reads: `Loss.frozen`) it declares, and the step provides it
the same way for every loss.
"""

import abc
import functools
from typing import Any, Callable, Mapping, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding

from maxbridge.core import canonical, initializers, layouts, sharding
from maxbridge.training import optimizers
from maxbridge.ops import quantization
from maxbridge.core.config import Config
from maxbridge.training.loss import Forward, Loss
from maxbridge.training.trainable import AllParams, Trainable

Batch = Mapping[str, jax.Array]
Params = dict[str, Any]
# (canonical parameters after the update, this step's metrics) -> canonical parameters.
AfterUpdate = Callable[[Params, dict], Params]


class Bound(NamedTuple):
  """A train state opened for one step by a backend's `_bind`."""

  params: Params  # what the step differentiates: the policy's trained tree, canonical
  frozen: Any  # the backend's own state the forward pass also reads (NNX: the model's non-parameters)
  stored: Params | None  # the policy's frozen tree, canonical (LoRA: the base)
  step: jax.Array  # the optimizer step this update makes (it sets the learning rate)
  handle: Any  # the backend's own, for `_run` and `_apply_update`
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


def _fresh(tree: Params) -> Params:
  # A new canonical tree: a caller editing it must not edit the state.
  return canonical.unflatten(canonical.flatten(tree))


class Trainer(abc.ABC):
  """The train step, written once; `maxbridge.train` drives either backend the same way.

  The state lives on `mesh`, each leaf sharded by its logical axes through
  the config's `logical_axis_rules` (with `shard_optimizer_over_data`, the
  optimizer state over "data" too: ZeRO-1); batches are split on the batch axes.
  `loss` is what the step minimises; `trainable` (a `Trainable` class) what
  trains; `after_update`, if given, maps the canonical parameters after each
  update (QK-Clip), the same on both backends.
  """

  def __init__(
      self,
      config: Config,
      abstract_params: dict,
      kernel_axes: dict,
      mesh: Mesh | None = None,
      *,
      loss: Loss,
      trainable: type[Trainable] = AllParams,
      after_update: AfterUpdate | None = None,
  ):
    self.config = config
    self.mesh = sharding.create_mesh(config) if mesh is None else mesh
    self.rules = config.logical_axis_rules
    self.schedule = optimizers.learning_rate_schedule(config)
    self.abstract_params = abstract_params
    self.kernel_axes = kernel_axes
    self.trainable = trainable(config, abstract_params, kernel_axes)
    self.tx = optimizers.create(config, self.trainable.trained_axes)
    self.loss = loss
    self.after_update = after_update
    # The parameters of the frozen model the loss reads (`Loss.frozen`), placed where the step takes them; see
    # hold_frozen.
    self.frozen_params: Any = None

  @property
  def saves_params(self) -> bool:
    """Whether checkpoints hold the parameters (LoRA's hold the adapters only, see `restore`)."""
    return self.trainable.saves_params

  def _initial_params(self, seed) -> dict:
    """The canonical initial parameters, each in its sharding (on one device: create_model's draws)."""
    spec = tuple((path, leaf.shape, leaf.dtype.name) for path, leaf in canonical.flatten(self.abstract_params).items())
    shardings = None
    if self.mesh.size > 1:
      axes = canonical.flatten(self.kernel_axes)
      shardings = tuple(sharding.named_sharding(self.mesh, axes[path], self.rules) for path, *_ in spec)
    return initializers.jitted_init(spec, initializers.InitOptions.from_config(self.config), shardings)(seed)

  def _init(self, params, seed) -> Any:
    """The initial state around the canonical initial parameters (traceable)."""
    return self._new_state(*self.trainable.initial(params, seed))

  def abstract_state(self) -> Any:
    return jax.eval_shape(self._new_state, self.trainable.abstract_trained, self.trainable.abstract_stored)

  @functools.cached_property
  def _zero1(self) -> bool:
    """ZeRO-1 (`shard_optimizer_over_data`) on a mesh with a "data" axis to split over."""
    return self.config.shard_optimizer_over_data and self.mesh.shape["data"] > 1

  @functools.cached_property
  def _device_shardings(self) -> Any:
    """Where the step computes on the state: in device memory."""
    shardings = sharding.spec_tree_to_shardings(self.logical_specs(), self.mesh, self.rules)
    if not self._zero1:
      return shardings
    # ZeRO-1: the optimizer state (and so the update) split over "data" too; the parameters stay replicated on it.
    opt_state = jax.tree.map(
        sharding.with_data_axis, self.to_checkpoint(shardings)["opt_state"], self.disk_layout["opt_state"]
    )
    return self._with_tree(shardings, {"opt_state": opt_state})

  @functools.cached_property
  def _offloaded(self) -> tuple[str, ...]:
    """The parts of the state MaxText's host offload keys keep in host memory between steps."""
    parts = ("params", "stored") if self.config.parameter_memory_host_offload else ()
    return parts + (("opt_state",) if self.config.optimizer_memory_host_offload else ())

  @functools.cached_property
  def state_shardings(self) -> Any:
    """Where the state lives between steps: `_device_shardings`, what `_offloaded` names in pinned host memory
    (the step brings it to the devices and its outputs go back, as XLA schedules the copies)."""
    tree = self._tree(self._device_shardings)
    host = {
        key: jax.tree.map(lambda where: where.with_memory_kind("pinned_host"), tree[key])
        for key in self._offloaded
        if key in tree
    }
    return self._with_tree(self._device_shardings, host) if host else self._device_shardings

  def _to_devices(self, state, parts: tuple[str, ...] = ("params", "stored", "opt_state")):
    """`state` with its offloaded `parts` in device memory, for a step to compute on (traceable)."""
    parts = [part for part in parts if part in self._offloaded]
    if not parts:
      return state
    tree, device = self._tree(state), self._tree(self._device_shardings)
    return self._with_tree(state, {part: jax.device_put(tree[part], device[part]) for part in parts if part in tree})

  @functools.cached_property
  def _gradient_shardings(self) -> dict[str, NamedSharding]:
    """ZeRO-1: each trained leaf's path -> the sharding its summed gradient is reduced to (its optimizer state's)."""
    shapes = canonical.flatten(self.trainable.abstract_trained)
    return {
        path: sharding.with_data_axis(where, shapes[path])
        for path, where in canonical.flatten(self.trained_params(self.state_shardings)).items()
    }

  def _reduce_gradients(self, grads: Params) -> Params:
    """ZeRO-1: the summed gradients placed as their optimizer state is, split over "data", so that each device
    updates its slice (the parameters are then gathered back). Only after the accumulation scan: its carry keeps
    the parameters' sharding, as in MaxText's auto-sharding mode (a spec inside a scan carry is what its explicit
    mode had to move out)."""
    if not self._zero1:
      return grads
    return jax.tree_util.tree_map_with_path(
        lambda path, g: jax.lax.with_sharding_constraint(g, self._gradient_shardings[layouts.keypath_str(path)]),
        grads,
    )

  @functools.cached_property
  def batch_sharding(self) -> NamedSharding:
    return sharding.named_sharding(self.mesh, ("activation_batch", "activation_length"), self.rules)

  @functools.cached_property
  def _frozen_shardings(self) -> Any:
    return None if self.loss.frozen is None else self.loss.frozen.shardings(self)

  @functools.cached_property
  def _jitted_train_step(self):
    return jax.jit(
        self._train_step,
        in_shardings=(self.state_shardings, self.batch_sharding, self._frozen_shardings),
        out_shardings=(self.state_shardings, None),
        donate_argnums=0,
    )

  @functools.cached_property
  def _jitted_eval_step(self):
    return jax.jit(self._eval_step, in_shardings=(self.state_shardings, self.batch_sharding, self._frozen_shardings))

  def hold_frozen(self, start=None) -> Any:
    """Holds, and returns, the parameters of the frozen model the loss reads (`Loss.frozen`), placed where the step
    takes them: taken from `start`, the state training starts from, for a copy of the trained model as it started;
    a model of its own is read and placed once.

    `maxbridge.train`'s hooks call it as the run starts, also on resume, so a
    checkpoint holds the trained model only.
    """
    if self.loss.frozen is not None:
      with sharding.active(self.mesh, self.rules):
        self.frozen_params = self.loss.frozen.params(self, start, self.frozen_params)
    return self.frozen_params

  @functools.cached_property
  def _jitted_params(self):
    return jax.jit(self.params, out_shardings=self.params(self.state_shardings))

  def copy_params(self, state) -> Params:
    """A copy of `state`'s canonical parameters, each placed as the state holds it (compiled once)."""
    with sharding.active(self.mesh, self.rules):
      return self._jitted_params(state)

  def _frozen_arg(self, abstract: bool = False):
    if self.loss.frozen is None or self.frozen_params is not None:
      return self.frozen_params
    if abstract:  # ahead-of-time lowering needs shapes only: nothing is read or placed
      return self.loss.frozen.abstract(self)
    return self.hold_frozen()

  def train_step(self, state, batch: Batch):
    """(state, global batch) -> (new state, metrics); `state` is donated."""
    with sharding.active(self.mesh, self.rules):
      return self._jitted_train_step(state, self.loss_batch(batch), self._frozen_arg())

  def lower_train_step(self, state, batch: Batch):
    """The train step lowered for (possibly abstract, sharded) inputs: `.compile()` it."""
    with sharding.active(self.mesh, self.rules):
      return self._jitted_train_step.lower(state, self.loss_batch(batch), self._frozen_arg(abstract=True))

  def compile_train_step(self, state, batch: Batch):
    """(the compiled step, `step(state) -> (state, metrics)` running it on `batch`).

    One compile serves both XLA's analyses of the executable and timed steps.
    """
    compiled = self.lower_train_step(state, batch).compile()
    args = (self.loss_batch(batch), self._frozen_arg())

    def step(state):
      with sharding.active(self.mesh, self.rules):
        return compiled(state, *args)

    return compiled, step

  def eval_step(self, state, batch: Batch) -> dict:
    with sharding.active(self.mesh, self.rules):
      return self._jitted_eval_step(state, self.loss_batch(batch), self._frozen_arg())

  def init_state(self, seed: int):
    """The initial state, created directly in its shardings (never whole on one device)."""
    # The parameters' draws (initializers.jitted_init) are shared by every trainer, backend and create_model that
    # draws a leaf of their shape and sharding; then one program builds the state around them.
    with sharding.active(self.mesh, self.rules):
      return jax.jit(self._init, out_shardings=self.state_shardings)(self._initial_params(seed), seed)

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

  # --- the state's faces, written once ------------------------------------------
  #
  # `_tree` gives the state as the checkpoint tree (the trained tree, its
  # optimizer state, the step), plus the policy's frozen tree under "stored".

  @functools.cached_property
  def disk_layout(self) -> dict:
    """The on-disk tree, abstract (shapes and dtypes): the same for both backends."""
    params = {self.trainable.collection: self.trainable.abstract_trained}
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

  def to_checkpoint(self, state) -> dict:
    """The state's checkpoint tree (`disk_layout`'s); also maps trees of shardings or specs shaped as the state."""
    tree = self._tree(state)
    return int32_disk_step({key: tree[key] for key in ("params", "opt_state", "step")})

  def with_checkpoint(self, state, tree: dict):
    """`state` with the trained tree, optimizer state and step of a checkpoint tree (LoRA: the base kept)."""
    return self._with_tree(state, tree)

  def from_checkpoint(self, tree: dict) -> Any:
    """The state a checkpoint tree holds whole (see `restore` for one that holds the trained tree only)."""
    if not self.saves_params:
      raise ValueError(
          f"{type(self.trainable).__name__} checkpoints hold the trained tree only, not the model it trains: "
          "call trainer.with_checkpoint(state, tree) with a state holding the base"
      )
    return self._with_tree(self.abstract_state(), tree)

  def restore(self, tree: dict, initial: Callable[[], Any]) -> Any:
    """The state of a restored checkpoint tree; `initial()` builds the state the run started from, whose frozen
    base a checkpoint of the trained tree only (LoRA's) is put back into."""
    return self.from_checkpoint(tree) if self.saves_params else self.with_checkpoint(initial(), tree)

  def step(self, state) -> int:
    return int(self._tree(state)["step"])

  def params(self, state) -> Params:
    """Canonical parameters of a state (traceable); LoRA: the frozen base (QLoRA: its dequantized values)."""
    tree = self._tree(state)
    return _fresh(self.trainable.params(tree["params"][self.trainable.collection], tree.get("stored")))

  def replace_params(self, state, params: Params) -> Any:
    """`state` with its canonical parameters (as `params` reads them) replaced (traceable); the optimizer state
    is kept."""
    return self._with_tree(state, self.trainable.with_params(params))

  def model_params(self, state) -> Params:
    """The canonical parameters the model runs on, to sample or serve from (LoRA: the adapters merged in)."""
    tree = self._tree(state)
    return _fresh(self.trainable.view(tree["params"][self.trainable.collection], tree.get("stored")))

  def trained_params(self, state) -> Params:
    """The canonical tree the optimizer trains (LoRA: the adapters)."""
    return _fresh(self._tree(state)["params"][self.trainable.collection])

  def stored_base(self, state) -> Params | None:
    """The frozen base as the state holds it (QLoRA: `kernel_qvalue` + `kernel_scale` per layer kernel); None when
    the model's own parameters train."""
    stored = self._tree(state).get("stored")
    return None if stored is None else _fresh(stored)

  # --- the step, written once ---------------------------------------------

  def _canonical_view(self, bound: Bound, params: Params) -> Params:
    """The canonical parameters the model runs on when `params` are trained (LoRA: the base with the adapters
    merged in)."""
    return self.trainable.view(params, bound.stored, bound.step if bound.training else None)

  def _forward(self, bound: Bound, params: Params, frozen, tokens, positions, segment_ids):
    return self._run(bound, self._canonical_view(bound, params), frozen, tokens, positions, segment_ids)

  def state_logits(self, state, tokens, positions, segment_ids) -> jax.Array:
    """The train step's own forward pass over `state`'s model (LoRA: the adapters merged; no dropout): logits
    [B, T, V] (traceable). A policy-gradient learner's sampling-time log-probabilities come from it, so that a
    first update on the batch sees a ratio of exactly 1."""
    bound = self._bind(self._to_devices(state, ("params", "stored")))
    return self._forward(bound, bound.params, bound.frozen, tokens, positions, segment_ids)[0]

  def _loss(self, bound: Bound, params: Params, batch: Batch, frozen_params=None):
    apply = functools.partial(self._forward, bound)
    view = functools.partial(self._canonical_view, bound)
    policy = Forward(apply, params, bound.frozen, view)
    if self.loss.frozen is None:
      return self.loss(policy, batch)
    # The frozen model's pass, over the parameters the step started from, a frozen copy or a model's own: a
    # constant of the differentiation, so no gradient flows through it.
    frozen = self.loss.frozen.forward(self, policy.at(bound.params), frozen_params)
    return self.loss(policy, batch, frozen.at(jax.lax.stop_gradient(frozen.params)))

  def _train_step(self, state, batch: Batch, frozen_params=None):
    state = self._to_devices(state, ("params", "stored"))
    bound = self._bind(state)._replace(training=True)
    loss = functools.partial(self._loss, bound, frozen_params=frozen_params)
    value_and_grad = jax.value_and_grad(loss, has_aux=True)
    with quantization.stochastic_rounding(self.config, bound.step):
      grads, metrics = accumulate_gradients(value_and_grad, bound.params, batch, self.config.gradient_accumulation_steps)
    grads = self._reduce_gradients(grads)
    if "opt_state" in self._offloaded:
      # As MaxText's: the optimizer state comes to the devices for the update, ordered after the gradients by
      # the barrier (left to XLA, it is copied at the start and sits in HBM through the backward pass).
      opt_state, grads = jax.lax.optimization_barrier((self._tree(state)["opt_state"], grads))
      state = self._to_devices(self._with_tree(state, {"opt_state": opt_state}), ("opt_state",))
      bound = self._bind(state)._replace(training=True)
    grads, grad_norm = clip_gradients(grads, self.config.gradient_clipping_threshold)
    metrics = {**metrics, "grad_norm": grad_norm, "lr": self.schedule(bound.step)}
    state = self._apply_update(bound, grads)
    if self.after_update is not None:
      state = self.replace_params(state, self.after_update(self.params(state), metrics))
    return state, metrics

  def _eval_step(self, state, batch: Batch, frozen_params=None):
    bound = self._bind(self._to_devices(state, ("params", "stored")))
    loss_sum, aux = self._loss(bound, bound.params, batch, frozen_params)
    return {"loss": loss_sum / jnp.maximum(aux["tokens"], 1.0), "tokens": aux["tokens"]}

  # --- backend hooks ---------------------------------------------------------

  @abc.abstractmethod
  def _new_state(self, trained: Params, stored: Params | None) -> Any:
    """The state holding the policy's trees, with a fresh optimizer over `trained` (traceable)."""

  @abc.abstractmethod
  def logical_specs(self) -> Any:
    """The state's tree with a logical PartitionSpec per leaf, from the backend's metadata."""

  @abc.abstractmethod
  def _bind(self, state) -> Bound:
    """Opens `state` for one step: the trained tree (differentiated), the rest the forward pass reads."""

  @abc.abstractmethod
  def _run(self, bound: Bound, params: Params, frozen, tokens, positions, segment_ids):
    """(logits, flat intermediates) of the model on canonical `params`, with `frozen` in place of `bound`'s."""

  @abc.abstractmethod
  def _apply_update(self, bound: Bound, grads: Params) -> Any:
    """The new state: the optimizer applied to `grads` (the tree of `bound.params`)."""

  @abc.abstractmethod
  def _tree(self, state) -> dict:
    """The state as the checkpoint tree, plus "stored": the policy's frozen tree when it has one (traceable)."""

  @abc.abstractmethod
  def _with_tree(self, state, tree: dict) -> Any:
    """`state` with the parts of `tree` (a `_tree`'s, any of its keys) replaced (traceable); `state` is kept."""


# --- the on-disk step ---------------------------------------------------


def int32_disk_step(tree: dict) -> dict:
  """A checkpoint tree with its step as int32, as Linen's train state holds it (NNX's optimizer counts in uint32).

  The same mapping also carries trees of shardings, whose step has no dtype: left as it is.
  """
  step = tree["step"]
  return {**tree, "step": step.astype(jnp.int32) if hasattr(step, "astype") else step}
