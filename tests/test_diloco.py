"""DiLoCo (enable_diloco): the outer step's math, H=1 against plain training, exact resume across backends, 8
devices with 2 replicas (tests/diloco_multidevice.py, one subprocess), and what it refuses."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import optax
import pytest

import maxbridge as mb
from maxbridge.core import canonical, checkpointing
from maxbridge.core.config import ConfigError
from maxbridge.training import aot, data, diloco, recipe
from conftest import failure, tiny_config

HERE = Path(__file__).parent
LINEN, NNX, MIX = (False, False, False), (True, True, True), (True, False, True)


def test_outer_step_is_nesterov_sgd_on_the_mean_delta():
  tx = optax.sgd(0.5, momentum=0.9, nesterov=True)
  params = {"w": np.array([1.0, 2.0], np.float32)}
  opt_state = tx.init(params)
  trace = np.zeros(2, np.float32)
  for replicas in ([[0.0, 2.0], [1.0, 1.0]], [[3.0, 3.0], [1.0, 2.0]]):
    replicas = np.array(replicas, np.float32)
    delta = np.mean(params["w"][None] - replicas, axis=0)  # the pseudo-gradient, written out
    trace = 0.9 * trace + delta
    want = params["w"] - 0.5 * (delta + 0.9 * trace)
    params, opt_state = diloco.outer_step(tx, params, opt_state, {"w": replicas})
    np.testing.assert_allclose(params["w"], want, rtol=1e-6)


def _losses_and_params(trainer, steps=3):
  batches = data.make_dataset(trainer.config, "train", 2)
  state, losses = trainer.init_state(0), []
  for step in range(steps):
    state, metrics = trainer.train_step(state, trainer.shard_batch(batches.batch(step)))
    losses.append(float(metrics["loss"]))
  losses.append(float(trainer.eval_step(state, trainer.shard_batch(batches.batch(steps)))["loss"]))  # the global model's
  return losses, {path: np.asarray(x) for path, x in canonical.flatten(trainer.params(state)).items()}


@pytest.mark.parametrize(
    "inner",
    [{}, dict(gradient_accumulation_steps=2), dict(opt_type="muon"), dict(mtp_num_layers=1)],
    ids=["adamw", "accumulated", "muon", "mtp"],
)
def test_h1_with_outer_sgd_lr_1_no_momentum_equals_plain_training_across_backends(inner):
  """One replica on one device, whatever the inner step does (micro-batches, Muon, MTP's extra loss);
  tests/diloco_multidevice.py checks two replicas against data parallelism."""
  plain_losses, plain_params = _losses_and_params(recipe.create_trainer(tiny_config(LINEN, **inner)))
  one = dict(enable_diloco=True, diloco_sync_period=1, diloco_outer_lr=1.0, diloco_outer_momentum=0.0)
  losses, params = _losses_and_params(recipe.create_trainer(tiny_config(NNX, **one, **inner)))
  assert plain_losses[-2] < plain_losses[0]
  np.testing.assert_allclose(losses, plain_losses, rtol=1e-6)  # the train steps' losses, then an eval step's
  assert sorted(params) == sorted(plain_params)
  for path, value in plain_params.items():
    np.testing.assert_allclose(params[path], value, atol=1e-6, rtol=0, err_msg=path)


@pytest.fixture(scope="module")
def h3_trainers():
  """H=3 with the outer Nesterov momentum: a Linen trainer and a bridged NNX one (compiled once each)."""
  options = dict(enable_diloco=True, diloco_sync_period=3, steps=5, eval_interval=0, checkpoint_period=2)
  return {name: recipe.create_trainer(tiny_config(flags, **options)) for name, flags in (("linen", LINEN), ("mix", MIX))}


def test_checkpoints_hold_the_global_model_the_outer_state_and_the_replicas_states(h3_trainers):
  layout = h3_trainers["linen"].disk_layout
  assert set(layout) == {"params", "opt_state", "step", "diloco"}
  # The global model where a plain run's parameters are: generate and load_parameters_path read it as one.
  assert layout["params"] == {"params": h3_trainers["linen"].abstract_params}
  embedding = layout["params"]["params"]["token_embedder"]["embedding"]
  assert layout["opt_state"][0]["trace"]["token_embedder"]["embedding"].shape == embedding.shape
  replicas = layout["diloco"]
  assert replicas["params"]["params"]["token_embedder"]["embedding"].shape == (1, *embedding.shape)
  assert replicas["opt_state"][0]["mu"]["params"]["token_embedder"]["embedding"].shape == (1, *embedding.shape)
  assert h3_trainers["mix"].disk_layout == layout  # one layout for both backends


def test_diloco_trains_and_a_linen_run_resumed_with_nnx_flags_between_syncs_is_exact(h3_trainers, tmp_path):
  def run(name, combo, **options):
    config = h3_trainers[combo].config.replace(base_output_directory=str(tmp_path), run_name=name)
    return mb.train(config, trainer=h3_trainers[combo], progress=False, **options)

  whole = [r["loss"] for r in run("whole", "linen")]
  assert whole[-1] < whole[0] - 0.05, whole
  run("flip", "linen", until_step=2)  # step 2: between the syncs after steps 0..2 (inner step 3) and 3..5
  resumed = run("flip", "mix")
  assert [r["step"] for r in resumed] == [2, 3, 4]
  np.testing.assert_allclose([r["loss"] for r in resumed], whole[2:], rtol=1e-6)
  # The run's checkpoint holds the global model as a plain run's parameters: any reader of ours takes it as one.
  params, _ = checkpointing.load_params(tmp_path / "whole")
  shapes = {path: x.shape for path, x in canonical.flatten(h3_trainers["linen"].abstract_params).items()}
  assert {path: x.shape for path, x in canonical.flatten(params).items()} == shapes


@pytest.fixture(scope="module")
def multidevice():
  proc = subprocess.run(
      [sys.executable, str(HERE / "diloco_multidevice.py")], capture_output=True, text=True, timeout=900, cwd=HERE
  )
  assert proc.returncode == 0, failure(proc.stderr)
  return json.loads(proc.stdout.strip().splitlines()[-1])


def test_two_replicas_with_h1_equal_data_parallel_training_on_8_devices(multidevice):
  assert multidevice["devices"] == 8
  h1 = multidevice["h1"]
  np.testing.assert_allclose(h1["diloco_losses"], h1["plain_losses"], rtol=1e-6)
  assert h1["max_param_change"] > 1e-2  # the runs moved: equal parameters are not the initial ones
  assert h1["max_param_difference"] < 1e-6


def test_two_replicas_train_apart_between_syncs_sharded_over_diloco(multidevice):
  run = multidevice["two_replicas"]
  assert run["losses"][-1] < run["losses"][0] - 0.5, run["losses"]
  apart = run["apart"]
  for step in ("2", "4", "5"):  # between syncs: each replica's own data, its own parameters
    assert apart[step]["replicas_differ"] > 1e-4 and apart[step]["replica_vs_global"] > 1e-4, apart
  for step in ("3", "6"):  # after the outer step every replica holds the global parameters
    assert apart[step]["replicas_differ"] == 0 and apart[step]["replica_vs_global"] == 0, apart
  assert all(spec.startswith("P('diloco'") for spec in run["inner_specs"])
  assert not any("diloco" in spec for spec in run["outer_specs"])
  assert run["replica_leaf_shape"][0] == 2 and run["replica_leaf_spec"].startswith("P('diloco'")
  assert run["batch_spec"].startswith("P(('diloco', 'data', 'fsdp'")


@pytest.mark.parametrize(
    "overrides, named",
    [
        (dict(ici_diloco_parallelism=2), "enable_diloco=true"),
        (dict(enable_diloco=True, ici_pipeline_parallelism=2, scan_layers=True), "ici_pipeline_parallelism"),
        (dict(enable_diloco=True, shard_optimizer_over_data=True), "ZeRO-1"),
        (dict(enable_diloco=True, use_dpo=True), "use_dpo"),
        (dict(enable_diloco=True, use_grpo=True), "use_grpo"),
        (dict(enable_diloco=True, lora_rank=4), "lora_rank"),
        (dict(enable_diloco=True, ici_diloco_parallelism=-1), "neither may be -1"),
    ],
)
def test_what_diloco_does_not_combine_with_is_refused_by_name(overrides, named):
  with pytest.raises(ConfigError, match=named):
    tiny_config(LINEN, **overrides)


def test_a_batch_that_does_not_split_over_the_replicas_is_refused():
  trainer = recipe.create_trainer(tiny_config(LINEN, enable_diloco=True))
  trainer.num_replicas = 2  # as on a mesh of two replicas, which one device cannot hold
  batch = {key: np.zeros((3, 8), np.int32) for key in trainer.loss.batch_keys}
  with pytest.raises(ValueError, match="3 rows does not split over 2 DiLoCo replicas"):
    trainer.shard_batch(batch)


def test_the_sharding_table_lists_the_replicas_split_over_diloco():
  config = mb.load_config("llama-tiny", enable_diloco=True, ici_diloco_parallelism=2)
  rows = aot.sharding_rows(config, aot.abstract_mesh(config, 8))
  replicas = {row["path"]: row for row in rows if row["group"] == "replicas"}
  kernel = replicas["diloco/params/params/decoder/logits_dense/kernel"]
  assert kernel["shape"][0] == 2 and kernel["logical_axes"][0] == "diloco" and kernel["spec"][0] == "diloco"
  params = {row["path"]: row for row in rows if row["group"] == "parameters"}
  assert params["decoder/logits_dense/kernel"]["shape"] == kernel["shape"][1:]
  assert "replicas:" in aot.format_table(rows, aot.abstract_mesh(config, 8))
