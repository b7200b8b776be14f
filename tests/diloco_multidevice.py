"""DiLoCo on 8 virtual CPU devices (2 replicas of 4); prints one JSON report for tests/test_diloco.py.

A subprocess, because the device count must be fixed (XLA_FLAGS) before JAX is imported.
"""

import json
import os

from fast_compile import xla_flags  # a constant; imports no JAX

os.environ["XLA_FLAGS"] = xla_flags(8)

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402

import maxbridge as mb  # noqa: E402
from maxbridge.core import canonical  # noqa: E402
from maxbridge.training import data, recipe  # noqa: E402

LINEN, NNX = (False, False, False), (True, True, True)
STEPS = 3
# AdamW with an eps far above every sqrt(nu) updates by lr / eps * mu: SGD with momentum, linear in the gradient.
# Then the mean of the replicas' updates is the update of their mean gradient, and DiLoCo with H=1, an outer SGD
# at lr 1 and no momentum must equal data-parallel training; with AdamW's usual eps it would not (its update is
# not linear in the gradient).
LINEAR_ADAM = dict(
    learning_rate=1e6,
    adam_eps=1e7,
    adam_weight_decay=0.0,
    gradient_clipping_threshold=0.0,
    warmup_steps_fraction=0.0,
)


def config(flags, **overrides):
  pure_nnx, enable_nnx, decoder = flags
  return mb.load_config(
      "llama-tiny", pure_nnx=pure_nnx, enable_nnx=enable_nnx, pure_nnx_decoder=decoder, steps=10, **overrides
  )


def train(trainer, steps, inspect=None):
  batches = data.make_dataset(trainer.config, "train", 8)
  state, losses = trainer.init_state(0), []
  for step in range(steps):
    state, metrics = trainer.train_step(state, trainer.shard_batch(batches.batch(step)))
    losses.append(float(metrics["loss"]))
    if inspect:
      inspect(step, state)
  return state, losses


def flat(params):
  return {path: np.asarray(value) for path, value in canonical.flatten(jax.device_get(params)).items()}


def max_difference(a, b):
  return max(float(np.max(np.abs(a[path] - b[path]))) for path in a)


def main():
  report = {"devices": jax.device_count()}

  # 1. H=1, outer SGD lr 1, momentum 0, 2 replicas == data-parallel over the 8 devices (same global batch).
  plain = recipe.create_trainer(config(LINEN, **LINEAR_ADAM))
  plain_state, plain_losses = train(plain, STEPS)
  diloco = recipe.create_trainer(
      config(
          LINEN,
          enable_diloco=True,
          ici_diloco_parallelism=2,
          diloco_sync_period=1,
          diloco_outer_lr=1.0,
          diloco_outer_momentum=0.0,
          **LINEAR_ADAM,
      )
  )
  diloco_state, diloco_losses = train(diloco, STEPS)
  report["h1"] = {
      "plain_losses": plain_losses,
      "diloco_losses": diloco_losses,
      "max_param_difference": max_difference(flat(plain.params(plain_state)), flat(diloco.params(diloco_state))),
      "max_param_change": max_difference(flat(plain.params(plain_state)), flat(plain.params(plain.init_state(0)))),
  }

  # 2. Two replicas with AdamW, H=3 and the outer Nesterov step (NNX): they train, apart between syncs.
  trainer = recipe.create_trainer(
      config(NNX, enable_diloco=True, ici_diloco_parallelism=2, diloco_sync_period=3, learning_rate=3e-3)
  )
  apart = {}

  def inspect(step, state):
    replicas = flat(trainer.inner._tree(state["inner"])["params"]["params"])
    outer = flat(trainer.params(state))
    apart[step + 1] = {
        "replicas_differ": max(float(np.max(np.abs(v[0] - v[1]))) for v in replicas.values()),
        "replica_vs_global": max(float(np.max(np.abs(replicas[p][0] - outer[p]))) for p in outer),
    }

  state, losses = train(trainer, 6, inspect)
  shardings = trainer.state_shardings
  inner_specs = {str(where.spec) for where in jax.tree.leaves(trainer.inner._tree(shardings["inner"])["params"])}
  outer_specs = {str(where.spec) for where in jax.tree.leaves(shardings["outer"]["params"])}
  some_replica_leaf = jax.tree.leaves(trainer.inner._tree(state["inner"])["params"])[0]
  report["two_replicas"] = {
      "losses": losses,
      "apart": apart,
      "inner_specs": sorted(inner_specs),
      "outer_specs": sorted(outer_specs),
      "replica_leaf_shape": list(some_replica_leaf.shape),
      "replica_leaf_spec": str(some_replica_leaf.sharding.spec),
      "batch_spec": str(trainer.batch_sharding.spec),
  }
  print(json.dumps(report))


if __name__ == "__main__":
  main()
