"""Train state and train step for both backends, behind one interface.

Linen: flax's `TrainState`, its params under a {"params": ...} collection level
as MaxText keeps them. NNX: `TrainStateNNX(model, optimizer)`; the step lives
in the `nnx.Optimizer`. Both speak the same on-disk layout (MaxText's):

    {"params": {"params": <canonical tree>},
     "opt_state": [{"count", "mu": {"params": ...}, "nu": {"params": ...}}, None, {"count"}],
     "step": int32}

`maxbridge.dispatch.create_trainer` picks the backend; nothing else here reads
a flag.
"""

import abc
import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import flax.linen as nn
import optax
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh, NamedSharding

from maxbridge import canonical, initializers, layouts, optimizers, sharding
from maxbridge.config import Config
from maxbridge.model import LinenModel, flat_intermediates
from maxbridge.ops import losses

Batch = Mapping[str, jax.Array]


class TrainStateNNX(nnx.Module):
  """The NNX train state: the model and its optimizer (which holds the step)."""

  def __init__(self, model: nnx.Module, optimizer: nnx.Optimizer):
    self.model = model
    self.optimizer = optimizer


def loss_terms(logits: jax.Array, batch: Batch, config: Config, intermediates: Mapping[str, Any]):
  """(sum of per-token losses, {"tokens", "z_loss", "moe_lb_loss"}) over the non-padding targets.

  Sums, not means: gradient accumulation adds these up and divides once by
  the total token count, which makes it the same update as the full batch.
  The MoE load-balancing loss (sown by MoE decoders, already weighted) is a
  per-batch mean, so it enters weighted by this batch's token count.
  """
  per_token, z_loss = losses.cross_entropy_with_z_loss(
      logits, batch["targets"], z_loss_multiplier=config.z_loss_multiplier
  )
  mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
  tokens = jnp.sum(mask)
  moe_lb_loss = intermediates.get("decoder/moe_lb_loss", jnp.float32(0.0)) * tokens
  aux = {"tokens": tokens, "z_loss": jnp.sum(z_loss * mask), "moe_lb_loss": moe_lb_loss}
  return jnp.sum(per_token * mask) + moe_lb_loss, aux


def accumulate_gradients(value_and_grad: Callable, params: Any, batch: Batch, num_micro: int):
  """Mean loss and gradient over all tokens of `batch`, in `num_micro` sequential micro-batches."""
  if num_micro == 1:
    (loss_sum, aux), grads = value_and_grad(params, batch)
  else:
    micro = jax.tree.map(lambda x: x.reshape(num_micro, x.shape[0] // num_micro, *x.shape[1:]), batch)

    def add(total, micro_batch):
      return jax.tree.map(jnp.add, total, value_and_grad(params, micro_batch)), None

    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(value_and_grad, params, jax.tree.map(lambda x: x[0], micro)))
    ((loss_sum, aux), grads), _ = jax.lax.scan(add, zeros, micro)
  tokens = jnp.maximum(aux["tokens"], 1.0)
  grads = jax.tree.map(lambda g: g / tokens, grads)
  metrics = {"loss": loss_sum / tokens, "z_loss": aux["z_loss"] / tokens, "tokens": aux["tokens"]}
  return grads, {**metrics, "moe_lb_loss": aux["moe_lb_loss"] / tokens}


def clip_gradients(grads: Any, threshold: float):
  """Global-norm clipping outside the optimizer (MaxText's way), and the raw norm."""
  norm = optax.tree.norm(grads)
  if threshold > 0:
    grads, _ = optax.clip_by_global_norm(threshold).update(grads, optax.EmptyState())
  return grads, norm


class Trainer(abc.ABC):
  """Backend-specific state handling; `train.py` drives either one the same way.

  The state lives on `mesh`, each leaf sharded by its logical axes through
  the config's `logical_axis_rules`; batches are split on the batch axes.
  """

  def __init__(self, config: Config, abstract_params: dict, mesh: Mesh | None = None):
    self.config = config
    self.mesh = sharding.create_mesh(config) if mesh is None else mesh
    self.rules = config.logical_axis_rules
    self.tx = optimizers.adamw(config)
    self.schedule = optimizers.learning_rate_schedule(config)
    self.abstract_params = abstract_params

  def _initial_params(self, seed) -> dict:
    return initializers.init_params(self.abstract_params, seed, initializers.InitOptions.from_config(self.config))

  @functools.cached_property
  def state_shardings(self) -> Any:
    return sharding.spec_tree_to_shardings(self.logical_specs(), self.mesh, self.rules)

  @functools.cached_property
  def batch_sharding(self) -> NamedSharding:
    return sharding.named_sharding(self.mesh, ("activation_batch", "activation_length"), self.rules)

  @functools.cached_property
  def _jitted_train_step(self):
    return jax.jit(
        self._train_step,
        in_shardings=(self.state_shardings, self.batch_sharding),
        out_shardings=(self.state_shardings, None),
        donate_argnums=0,
    )

  @functools.cached_property
  def _jitted_eval_step(self):
    return jax.jit(self._eval_step, in_shardings=(self.state_shardings, self.batch_sharding))

  def train_step(self, state, batch: Batch):
    """(state, global batch) -> (new state, metrics); `state` is donated."""
    with sharding.active(self.mesh, self.rules):
      return self._jitted_train_step(state, batch)

  def lower_train_step(self, state, batch: Batch):
    """The train step lowered for (possibly abstract, sharded) inputs: `.compile()` it."""
    with sharding.active(self.mesh, self.rules):
      return self._jitted_train_step.lower(state, batch)

  def eval_step(self, state, batch: Batch) -> dict:
    with sharding.active(self.mesh, self.rules):
      return self._jitted_eval_step(state, batch)

  def init_state(self, seed: int):
    """The initial state, created directly in its shardings (never whole on one device)."""
    with sharding.active(self.mesh, self.rules):
      return jax.jit(self._init, out_shardings=self.state_shardings)(seed)

  def shard_batch(self, local_batch: dict) -> dict:
    """This process's rows -> global arrays split over the mesh's batch axes."""
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

  def _step_metrics(self, step, grads_metrics, grad_norm) -> dict:
    return {**grads_metrics, "grad_norm": grad_norm, "lr": self.schedule(step)}

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
    """Canonical parameters of a state."""

  @abc.abstractmethod
  def step(self, state) -> int:
    ...

  @abc.abstractmethod
  def to_checkpoint(self, state) -> dict:
    ...

  @abc.abstractmethod
  def from_checkpoint(self, tree: dict) -> Any:
    ...

  @abc.abstractmethod
  def _train_step(self, state, batch: Batch):
    ...

  @abc.abstractmethod
  def _eval_step(self, state, batch: Batch):
    ...


class LinenTrainer(Trainer):

  def __init__(self, config: Config, model: LinenModel, mesh: Mesh | None = None):
    self.model = model
    super().__init__(config, model.abstract_params(), mesh)

  def _create(self, params: dict) -> train_state.TrainState:
    return train_state.TrainState.create(apply_fn=self.model.apply, params={"params": params}, tx=self.tx)

  def abstract_state(self):
    return jax.eval_shape(self._create, self.abstract_params)

  def _init(self, seed):
    return self._create(self._initial_params(seed))

  def logical_specs(self):
    # Linen's logical boxes ride through optax: mu and nu come out boxed too.
    return nn.get_partition_spec(jax.eval_shape(self._create, self.model.boxed_params()))

  def params(self, state) -> dict:
    return canonical.unflatten(canonical.flatten(state.params["params"]))

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

  def _loss(self, params, batch):
    logits, intermediates = self.model.apply_with_intermediates(
        params["params"], batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"]
    )
    return loss_terms(logits, batch, self.config, intermediates)

  def _train_step(self, state, batch):
    value_and_grad = jax.value_and_grad(self._loss, has_aux=True)
    grads, metrics = accumulate_gradients(value_and_grad, state.params, batch, self.config.gradient_accumulation_steps)
    grads, grad_norm = clip_gradients(grads, self.config.gradient_clipping_threshold)
    metrics = self._step_metrics(state.step, metrics, grad_norm)
    return state.apply_gradients(grads=grads), metrics

  def _eval_step(self, state, batch):
    loss_sum, aux = self._loss(state.params, batch)
    return {"loss": loss_sum / jnp.maximum(aux["tokens"], 1.0), "tokens": aux["tokens"]}


class NNXTrainer(Trainer):
  """NNX train state, stepped by `jax.jit` over split state with the graph definition static.

  `nnx.jit` would re-traverse the object graph on every call, which costs
  several times the step itself on small models; a static GraphDef does not.
  """

  def __init__(self, config: Config, build_model: Callable[[nnx.Rngs], nnx.Module], mesh: Mesh | None = None):
    self.build_model = build_model
    abstract_model = nnx.eval_shape(lambda: build_model(nnx.Rngs(params=0)))
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
        nnx.to_pure_dict(nnx.state(abstract_model, nnx.Param)),
    )
    super().__init__(config, canonical.unflatten(canonical.flatten(abstract)), mesh)
    self.graphdef, self._abstract_state = nnx.split(nnx.eval_shape(lambda: self._create(0)))

  def _create(self, seed) -> TrainStateNNX:
    # Built inside jit or eval_shape only: the module's own random initial
    # values are dead code once the canonical ones are written over them.
    model = self.build_model(nnx.Rngs(params=0))
    nnx.update(model, self._initial_params(seed))
    return TrainStateNNX(model, nnx.Optimizer(model, self.tx, wrt=nnx.Param))

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

  def step(self, state) -> int:
    return int(nnx.to_pure_dict(state)["optimizer"]["step"])

  def to_checkpoint(self, state) -> dict:
    tree = layouts.nnx_to_linen(nnx.to_pure_dict(state), self.disk_layout)
    return {**tree, "step": _as_int32(tree["step"])}

  def from_checkpoint(self, tree: dict):
    pure = layouts.linen_to_nnx(tree)
    pure["optimizer"]["step"] = jnp.asarray(pure["optimizer"]["step"], jnp.uint32)
    state = jax.tree.map(lambda x: x, self._abstract_state)  # a fresh State to fill
    nnx.replace_by_pure_dict(state, pure)
    return state

  def _split_model(self, state):
    train_state = nnx.merge(self.graphdef, state)
    graphdef, params, rest = nnx.split(train_state.model, nnx.Param, ...)
    return train_state, graphdef, params, rest

  def _loss_fn(self, graphdef, rest):
    def loss(params, batch):
      model = nnx.merge(graphdef, params, rest)
      logits = model(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
      intermediates = flat_intermediates(nnx.to_pure_dict(nnx.state(model, nnx.Intermediate)))
      return loss_terms(logits, batch, self.config, intermediates)

    return loss

  def _train_step(self, state, batch):
    train_state, graphdef, params, rest = self._split_model(state)
    value_and_grad = jax.value_and_grad(self._loss_fn(graphdef, rest), has_aux=True)
    grads, metrics = accumulate_gradients(value_and_grad, params, batch, self.config.gradient_accumulation_steps)
    grads, grad_norm = clip_gradients(grads, self.config.gradient_clipping_threshold)
    metrics = self._step_metrics(train_state.optimizer.step[...], metrics, grad_norm)
    train_state.optimizer.update(train_state.model, grads)
    # Sown intermediates would make the output tree differ from the input
    # (and break donation); they are never state.
    return nnx.state(train_state, nnx.Not(nnx.Intermediate)), metrics

  def _eval_step(self, state, batch):
    _, graphdef, params, rest = self._split_model(state)
    loss_sum, aux = self._loss_fn(graphdef, rest)(params, batch)
    return {"loss": loss_sum / jnp.maximum(aux["tokens"], 1.0), "tokens": aux["tokens"]}


# --- the on-disk step ---------------------------------------------------


def _as_int32(step: Any) -> Any:
  # The same mapping also carries trees of shardings, which have no dtype.
  return step.astype(jnp.int32) if hasattr(step, "astype") else step
