"""DiLoCo (Douillard et al., 2023): replicas that train apart and meet every H steps, on both backends.

`enable_diloco` splits the devices into `ici_diloco_parallelism` x
`dcn_diloco_parallelism` replicas along the mesh's outermost axis, "diloco"
(MaxText's), which maps to the data-centre network on a real cluster. Each
replica takes the run's own train step (the inner optimizer: AdamW, or Muon) on
its share of the batch (the global batch split over "diloco"), with its own
copy of the parameters and of the inner optimizer state. Every
`diloco_sync_period` (H) inner steps comes the outer step: the replicas'
parameter deltas from the global parameters, averaged, are the pseudo-gradient
of optax's Nesterov SGD (`diloco_outer_lr`, `diloco_outer_momentum`) on the
global parameters, which then replace every replica's. The inner optimizer
states are kept across a sync, as in the paper (section 6.1) and MaxText's
`diloco.py`. Between syncs nothing crosses "diloco": the outer step's mean is
the only communication over it.

The replicas are one leading dimension of the inner state, sharded over
"diloco", and the inner step is `jax.vmap`ped over it with
`spmd_axis_name="diloco"`, so every sharding constraint inside the step keeps
the replica dimension on that axis. That is what `drjax` (MaxText's choice)
does under its `map_fn`/`reduce_mean`; with one vmap and one mean, it would
add a dependency and a second way to name the placement, and nothing else.

The trainer wraps the run's own `Trainer` (`maxbridge.training.trainer`)
and works on its canonical trees, so it is the same for Linen, NNX and the
bridged mixes. Its checkpoint holds the global model where a plain run's
parameters are (so `generate`, `load_parameters_path` and the converters read
a DiLoCo run as any other), the outer SGD's state in place of the optimizer's,
and the replicas' own states in the plain layout with a leading replica
dimension:

    {"params": {"params": <canonical>}, "opt_state": <the outer SGD's>, "step": int32,
     "diloco": {"params": {"params": [N, ...] canonical}, "opt_state": [N, ...] (the inner optimizer's)}}

so a Linen run resumes with the NNX flags, exactly, at any step.
"""

import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from maxbridge.core import canonical, layouts, sharding
from maxbridge.core.config import Config
from maxbridge.training.trainer import Batch, Params, Trainer

AXIS = "diloco"


def _is_spec(x) -> bool:
  return isinstance(x, PartitionSpec)


def outer_optimizer(config: Config) -> optax.GradientTransformation:
  """The outer optimizer: Nesterov SGD on the pseudo-gradient, as MaxText's."""
  return optax.sgd(config.diloco_outer_lr, momentum=config.diloco_outer_momentum, nesterov=True)


def outer_step(tx: optax.GradientTransformation, params: Params, opt_state, replicas: Params):
  """(new global parameters, new outer state): the mean over the replicas (leading axis of `replicas`) of
  (global - replica) is the pseudo-gradient `tx` descends."""
  pseudo_grad = jax.tree.map(lambda g, r: jnp.mean(g[None] - r, axis=0).astype(g.dtype), params, replicas)
  updates, opt_state = tx.update(pseudo_grad, opt_state, params)
  return optax.apply_updates(params, updates), opt_state


class DiLoCoTrainer:
  """The run's trainer (`inner`) on N replicas with an outer step every `diloco_sync_period` steps.

  It answers what the loop, its hooks and `maxbridge.train` ask of a trainer:
  the state (`init_state`, `abstract_state`, `state_shardings`), the step
  (`train_step`, `eval_step`, `shard_batch`), checkpoints (`disk_layout`,
  `to_checkpoint`, `checkpoint_target`, `restore`) and the global model's
  canonical parameters (`params`).
  """

  fixed_keys = ("enable_diloco",)  # a DiLoCo checkpoint holds the replicas' states too

  def __init__(self, inner: Trainer):
    if not inner.trainable.trains_model:
      raise ValueError(f"DiLoCo trains every parameter; {type(inner.trainable).__name__} trains a part")
    self.inner = inner
    self.config, self.mesh, self.rules, self.loss = inner.config, inner.mesh, inner.rules, inner.loss
    self.abstract_params, self.kernel_axes = inner.abstract_params, inner.kernel_axes
    self.num_replicas = self.mesh.shape[AXIS]
    self.sync_period = self.config.diloco_sync_period
    self.outer_tx = outer_optimizer(self.config)
    self.saves_params = True

  @property
  def frozen_params(self):
    return self.inner.frozen_params

  def hold_frozen(self):
    """The inner trainer's frozen model of its own (`Trainer.hold_frozen`): one for every replica."""
    return self.inner.hold_frozen()

  # --- the state --------------------------------------------------------------

  def _stack(self, tree):
    return jax.tree.map(lambda x: jnp.broadcast_to(x, (self.num_replicas, *x.shape)), tree)

  def _from_single(self, single) -> dict:
    """The DiLoCo state of a plain one: every replica and the global model start from its parameters."""
    params = self.inner.params(single)
    return {"inner": self._stack(single), "outer": {"params": params, "opt_state": self.outer_tx.init(params)}}

  def abstract_state(self) -> dict:
    return jax.eval_shape(self._from_single, self.inner.abstract_state())

  def init_state(self, seed: int) -> dict:
    single = self.inner.init_state(seed)
    with sharding.active(self.mesh, self.rules):
      return jax.jit(self._from_single, out_shardings=self.state_shardings, donate_argnums=0)(single)

  def _on_replicas(self, where: NamedSharding) -> NamedSharding:
    return NamedSharding(self.mesh, PartitionSpec(AXIS, *where.spec))

  @functools.cached_property
  def state_shardings(self) -> dict:
    params = self.inner.params(self.inner.state_shardings)
    abstract_opt = jax.eval_shape(self.outer_tx.init, self.abstract_params)
    opt_state = optax.tree_map_params(
        self.outer_tx,
        lambda _, where: where,
        abstract_opt,
        params,
        transform_non_params=lambda _: NamedSharding(self.mesh, PartitionSpec()),
    )
    inner = jax.tree.map(self._on_replicas, self.inner.state_shardings)
    return {"inner": inner, "outer": {"params": params, "opt_state": opt_state}}

  @property
  def trainable(self):
    return self.inner.trainable

  def logical_specs(self) -> dict:
    """The state's tree of logical PartitionSpecs (`state_shardings`' shape): the replicas lead with `diloco`."""
    single = self.inner.logical_specs()
    params = self.inner.params(single)
    abstract_opt = jax.eval_shape(self.outer_tx.init, self.abstract_params)
    opt_state = optax.tree_map_params(
        self.outer_tx, lambda _, spec: spec, abstract_opt, params, transform_non_params=lambda _: PartitionSpec()
    )
    inner = jax.tree.map(lambda spec: PartitionSpec(AXIS, *spec), single, is_leaf=_is_spec)
    return {"inner": inner, "outer": {"params": params, "opt_state": opt_state}}

  @functools.cached_property
  def batch_sharding(self) -> NamedSharding:
    """The global batch's rows split over "diloco" first (replica r holds the r-th contiguous share), then as a
    plain run splits them."""
    rows, *rest = self.inner.batch_sharding.spec
    rows = (rows,) if isinstance(rows, str) else tuple(rows or ())
    return NamedSharding(self.mesh, PartitionSpec((AXIS, *rows), *rest))

  # --- the step ---------------------------------------------------------------

  def _inner_step(self, inner) -> jax.Array:
    return self.inner._tree(inner)["step"][0]

  def _replica_params(self, inner) -> Params:
    return self.inner._tree(inner)["params"][self.inner.trainable.collection]

  def _with_replica_params(self, inner, params: Params):
    """`inner` with every replica's parameters set to the (unstacked) canonical `params`."""
    return self.inner._with_tree(inner, {"params": {self.inner.trainable.collection: self._stack(params)}})

  def _synchronize(self, state: dict) -> dict:
    outer = state["outer"]
    params, opt_state = outer_step(
        self.outer_tx, outer["params"], outer["opt_state"], self._replica_params(state["inner"])
    )
    return {
        "inner": self._with_replica_params(state["inner"], params),
        "outer": {"params": params, "opt_state": opt_state},
    }

  def _mean_metrics(self, metrics: dict) -> dict:
    """The replicas' metrics as one run's: per-token means weighted by each replica's tokens, as a plain step
    over the whole batch reports them; the tokens summed; per-layer maxima (QK-Clip's) the largest."""
    tokens = metrics["tokens"]
    weights = tokens / jnp.maximum(jnp.sum(tokens), 1.0)
    out = {}
    for key, value in metrics.items():
      if key == "tokens":
        out[key] = jnp.sum(value)
      elif key == "maxima":
        out[key] = jax.tree.map(lambda x: jnp.max(x, axis=0), value)
      elif key == "lr":
        out[key] = value[0]
      else:
        out[key] = jnp.sum(weights.reshape(-1, *(1,) * (value.ndim - 1)) * value, axis=0)
    return out

  def _train_step(self, state: dict, batch: Batch, frozen_params=None):
    n = self.num_replicas
    split = jax.tree.map(lambda x: x.reshape(n, x.shape[0] // n, *x.shape[1:]), batch)
    step = jax.vmap(self.inner._train_step, in_axes=(0, 0, None), spmd_axis_name=AXIS)
    inner, metrics = step(state["inner"], split, frozen_params)
    state = {**state, "inner": inner}
    # After H inner steps (MaxText's test: the inner step count, once incremented, a multiple of H).
    state = jax.lax.cond(self._inner_step(inner) % self.sync_period == 0, self._synchronize, lambda s: s, state)
    return state, self._mean_metrics(metrics)

  def _eval_step(self, state: dict, batch: Batch, frozen_params=None):
    """The global model's loss (what the replicas are reset to at each sync)."""
    single = jax.tree.map(lambda x: x[0], state["inner"])
    single = self.inner._with_tree(single, {"params": {self.inner.trainable.collection: state["outer"]["params"]}})
    return self.inner._eval_step(single, batch, frozen_params)

  def _in_shardings(self):
    return (self.state_shardings, self.batch_sharding, self.inner._frozen_shardings)

  @functools.cached_property
  def _jitted_train_step(self):
    return jax.jit(
        self._train_step, in_shardings=self._in_shardings(), out_shardings=(self.state_shardings, None), donate_argnums=0
    )

  @functools.cached_property
  def _jitted_eval_step(self):
    return jax.jit(self._eval_step, in_shardings=self._in_shardings())

  def _args(self, batch: Batch, abstract: bool = False) -> tuple:
    inner = self.inner
    return (inner.loss_batch(batch), inner._frozen_arg(abstract))

  def train_step(self, state: dict, batch: Batch):
    """(state, global batch) -> (new state, metrics); `state` is donated."""
    with sharding.active(self.mesh, self.rules):
      return self._jitted_train_step(state, *self._args(batch))

  def lower_train_step(self, state, batch: Batch):
    with sharding.active(self.mesh, self.rules):
      return self._jitted_train_step.lower(state, *self._args(batch, abstract=True))

  def compile_train_step(self, state, batch: Batch):
    """(the compiled step, `step(state) -> (state, metrics)` running it on `batch`), as `Trainer`'s."""
    compiled = self.lower_train_step(state, batch).compile()
    args = self._args(batch)

    def step(state):
      with sharding.active(self.mesh, self.rules):
        return compiled(state, *args)

    return compiled, step

  def eval_step(self, state: dict, batch: Batch) -> dict:
    with sharding.active(self.mesh, self.rules):
      return self._jitted_eval_step(state, *self._args(batch))

  def loss_batch(self, batch: Mapping[str, Any]) -> dict:
    return self.inner.loss_batch(batch)

  def shard_batch(self, local_batch: Mapping[str, Any]) -> dict:
    """This process's rows -> global arrays split over "diloco" and the batch axes."""
    local_batch = self.inner.loss_batch(local_batch)
    rows = next(iter(local_batch.values())).shape[0] * jax.process_count()
    if rows % self.num_replicas:
      raise ValueError(
          f"a batch of {rows} rows does not split over {self.num_replicas} DiLoCo replicas "
          "(ici_diloco_parallelism x dcn_diloco_parallelism): make the global batch a multiple of it"
      )
    return {
        key: jax.make_array_from_process_local_data(self.batch_sharding, value, (rows, *value.shape[1:]))
        for key, value in local_batch.items()
    }

  # --- the state's faces --------------------------------------------------------

  def step(self, state: dict) -> int:
    return int(self._inner_step(state["inner"]))

  def params(self, state: dict) -> Params:
    """The global model's canonical parameters (traceable)."""
    return canonical.unflatten(canonical.flatten(state["outer"]["params"]))

  model_params = trained_params = params

  def stored_base(self, state) -> None:
    return None

  def replace_params(self, state: dict, params: Params) -> dict:
    """`state` with the global model and every replica set to `params`; the optimizer states kept (traceable)."""
    return {"inner": self._with_replica_params(state["inner"], params), "outer": {**state["outer"], "params": params}}

  @functools.cached_property
  def disk_layout(self) -> dict:
    inner = self.inner.disk_layout
    stacked = lambda x: jax.ShapeDtypeStruct((self.num_replicas, *x.shape), x.dtype)  # noqa: E731
    abstract_opt = jax.eval_shape(self.outer_tx.init, self.abstract_params)
    return {
        "params": {self.inner.trainable.collection: self.abstract_params},
        "opt_state": layouts.optax_to_tree(abstract_opt),
        "step": inner["step"],
        AXIS: {"params": jax.tree.map(stacked, inner["params"]), "opt_state": jax.tree.map(stacked, inner["opt_state"])},
    }

  def to_checkpoint(self, state: dict) -> dict:
    """The state's checkpoint tree (`disk_layout`'s); also maps the tree of the state's shardings."""
    tree = self.inner._tree(state["inner"])
    step = tree["step"]
    if hasattr(step, "astype"):
      step = step[0].astype(jnp.int32)
    else:  # a tree of shardings or logical specs: the one global step is replicated
      step = PartitionSpec() if _is_spec(step) else NamedSharding(self.mesh, PartitionSpec())
    outer = state["outer"]
    return {
        "params": {self.inner.trainable.collection: outer["params"]},
        "opt_state": layouts.optax_to_tree(outer["opt_state"]),
        "step": step,
        AXIS: {"params": tree["params"], "opt_state": tree["opt_state"]},
    }

  def checkpoint_target(self) -> dict:
    return jax.tree.map(
        lambda leaf, where: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=where),
        self.disk_layout,
        self.to_checkpoint(self.state_shardings),
    )

  def with_checkpoint(self, state: dict, tree: dict) -> dict:
    step = jnp.broadcast_to(jnp.asarray(tree["step"]), (self.num_replicas,))
    inner = self.inner._with_tree(state["inner"], {**tree[AXIS], "step": step})
    outer = {
        "params": tree["params"][self.inner.trainable.collection],
        "opt_state": layouts.optax_from_tree(state["outer"]["opt_state"], tree["opt_state"]),
    }
    return jax.device_put({"inner": inner, "outer": outer}, self.state_shardings)

  def from_checkpoint(self, tree: dict) -> dict:
    return self.with_checkpoint(self.abstract_state(), tree)

  def restore(self, tree: dict, initial=None) -> dict:
    del initial  # a DiLoCo checkpoint holds the whole state
    return self.from_checkpoint(tree)
