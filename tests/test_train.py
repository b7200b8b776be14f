"""One training loop for both backends: same losses, exact resume, flag flips, accumulation, guards."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxbridge as mb
from maxbridge import cli
from maxbridge.core import checkpointing
from maxbridge.training import data
from maxbridge.training.loop import TrainingDiverged, step_key
from maxbridge.training import loop as train_loop
from maxbridge.training import recipe
from conftest import LINEN_ARGS, LINEN_FLAGS, tiny_config

LINEN = (False, False, False)
NNX = (True, True, True)
STEPS = dict(steps=6, per_device_batch_size=4, checkpoint_period=3, eval_interval=3, eval_steps=2)


# Owned by this module, as a user would hold a trainer: runs that compute the
# same step (resumes, flips back) reuse its compiled step instead of compiling again.
TRAINERS = {}


def trainer_for(config):
  key = step_key(config)
  if key not in TRAINERS:
    TRAINERS[key] = recipe.create_trainer(config)
  return TRAINERS[key]


def run(tmp_path, name, flags=LINEN, until_step=None, **overrides):
  config = tiny_config(flags, base_output_directory=str(tmp_path), run_name=name, **{**STEPS, **overrides})
  return [r["loss"] for r in mb.train(config, trainer=trainer_for(config), until_step=until_step, progress=False)]


@pytest.fixture(scope="module")
def linen_losses(tmp_path_factory):
  return run(tmp_path_factory.mktemp("ref"), "linen")


def test_linen_and_nnx_from_scratch_log_the_same_losses(tmp_path, linen_losses):
  nnx_losses = run(tmp_path, "nnx", NNX)
  np.testing.assert_allclose(nnx_losses, linen_losses, rtol=1e-5)
  assert linen_losses[-1] < linen_losses[0] - 0.5, "the model should learn"


def test_mixed_flags_log_the_same_losses(tmp_path, linen_losses):
  np.testing.assert_allclose(run(tmp_path, "mixed", (True, False, True)), linen_losses, rtol=1e-5)


# A run written when Linen was the default records pure_nnx: false (and the other two) in its config.yml.
# `maxbridge train <preset>` resumes it with the flags of the command line, now NNX's; `maxbridge train
# <its config.yml>` with the flags it recorded.
RESUMED_FROM_THE_COMMAND_LINE = {"cli-preset": NNX, "cli-config.yml": LINEN}


def flags_of(config) -> tuple[bool, bool, bool]:
  return config.pure_nnx, config.enable_nnx, config.pure_nnx_decoder


def resume_from_the_command_line(tmp_path, name, how):
  """`maxbridge train` naming no flag on the run `name`; the losses of the steps it trained."""
  run_dir = tmp_path / name
  assert flags_of(mb.load_config(str(run_dir / "config.yml"))) == LINEN, "the run was written in Linen"
  if how == "cli-preset":
    values = {**STEPS, "base_output_directory": tmp_path, "run_name": name}
    argv = ["llama-tiny", *(f"{key}={value}" for key, value in values.items())]
  else:
    argv = [str(run_dir / "config.yml")]
  logged = len((run_dir / "metrics.jsonl").read_text().splitlines())
  assert cli.main(["train", *argv]) == 0
  # config.yml stays as the run began; the flags it resumed with are in its config history.
  assert flags_of(mb.load_config(str(run_dir / "config.yml"))) == LINEN
  latest = train_loop.latest_config(run_dir)
  assert (latest["pure_nnx"], latest["enable_nnx"], latest["pure_nnx_decoder"]) == RESUMED_FROM_THE_COMMAND_LINE[how]
  return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()[logged:]]


@pytest.mark.parametrize(
    "first,second",
    [(LINEN, LINEN), (LINEN, NNX), (NNX, LINEN), *((LINEN, how) for how in RESUMED_FROM_THE_COMMAND_LINE)],
    ids=["resume", "linen-to-nnx", "nnx-to-linen", "old-default-run-by-preset", "old-default-run-by-its-config.yml"],
)
def test_stopped_and_resumed_run_continues_the_curve(tmp_path, linen_losses, first, second):
  head = run(tmp_path, "split", first, until_step=3)
  if isinstance(second, str):
    tail = resume_from_the_command_line(tmp_path, "split", second)
  else:
    tail = run(tmp_path, "split", second)
  assert len(head) == 3 and len(tail) == 3
  np.testing.assert_allclose(head + tail, linen_losses, rtol=1e-5)
  records = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in records] == list(range(6))
  assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(records[0])
  assert "eval_loss" in records[2] and "eval_loss" in records[5]


def test_resume_drops_metrics_past_the_checkpoint(tmp_path):
  run(tmp_path, "r", until_step=3)
  log = tmp_path / "r" / "metrics.jsonl"
  # A crash after step 4 was logged but before its checkpoint: those lines go.
  log.write_text(log.read_text() + json.dumps({"step": 3, "loss": 0.0}) + "\n")
  run(tmp_path, "r")
  assert [json.loads(line)["step"] for line in log.read_text().splitlines()] == list(range(6))


def test_a_finished_run_does_nothing_when_run_again(tmp_path):
  run(tmp_path, "done")
  assert run(tmp_path, "done") == []


@pytest.mark.parametrize("flags", [LINEN, NNX], ids=["linen", "nnx"])
def test_gradient_accumulation_equals_the_full_batch(flags):
  """Same batch of 8 rows: one step of 8 vs 4 micro-batches of 2; grads and update agree."""
  batch = data.make_dataset(tiny_config(), "train", 8).batch(0)
  results = []
  for micro in (1, 4):
    trainer = recipe.create_trainer(tiny_config(flags, gradient_accumulation_steps=micro))
    state, metrics = trainer.train_step(trainer.init_state(0), batch)
    results.append((trainer.params(state), metrics))
  (full_params, full), (acc_params, acc) = results
  np.testing.assert_allclose(acc["grad_norm"], full["grad_norm"], rtol=1e-6)
  np.testing.assert_allclose(acc["loss"], full["loss"], rtol=1e-6)
  chex.assert_trees_all_close(acc_params, full_params, atol=1e-6, rtol=0)


def test_gradient_accumulation_grads_match_within_1e6():
  from maxbridge.training import trainer as state_lib

  config = tiny_config()
  trainer = recipe.create_trainer(config)
  params = trainer.params(trainer.init_state(0))
  batch = {k: jnp.asarray(v) for k, v in data.make_dataset(config, "train", 8).batch(0).items()}
  cross_entropy = recipe.create_loss(config)
  value_and_grad = jax.value_and_grad(
      lambda p, b: cross_entropy.terms(
          trainer.model.apply(p, b["inputs"], b["inputs_position"], b["inputs_segmentation"]), b, {}
      ),
      has_aux=True,
  )
  # Both jitted: op by op, the one-micro-batch reference cost more than both compiles together.
  full, _ = jax.jit(lambda p, b: state_lib.accumulate_gradients(value_and_grad, p, b, 1))(params, batch)
  accumulated, _ = jax.jit(lambda p, b: state_lib.accumulate_gradients(value_and_grad, p, b, 4))(params, batch)
  chex.assert_trees_all_close(accumulated, full, atol=1e-6, rtol=0)


def test_nan_loss_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path):
  with pytest.raises(
      TrainingDiverged,
      match=r"(loss is (nan|inf|-inf)|the state became non-finite) at step \d+.*last good checkpoint: step \d+",
  ):
    run(
        tmp_path,
        "nan",
        learning_rate=1e30,
        gradient_clipping_threshold=0.0,
        checkpoint_period=1,
        steps=20,
        eval_interval=0,
    )
  steps = checkpointing.Checkpointer(tmp_path / "nan" / "checkpoints").all_steps()
  assert steps, "the good steps before the divergence were checkpointed"
  trainer = recipe.create_trainer(tiny_config())
  restored = trainer.from_checkpoint(
      checkpointing.Checkpointer(tmp_path / "nan" / "checkpoints").restore(max(steps), trainer.checkpoint_target())
  )
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(trainer.params(restored)))


# A resume with another model's keys is refused naming them first (test_faults); a restore into another model's
# tree (a checkpoint read for a model it was not written for) names the first path that differs.


def _restore_as(tmp_path, name: str, **overrides):
  config = tiny_config(LINEN, base_output_directory=str(tmp_path), run_name=name, **{**STEPS, **overrides})
  ckpt = checkpointing.Checkpointer(tmp_path / name / "checkpoints")
  return ckpt.restore(ckpt.latest_step(), trainer_for(config).checkpoint_target())


def test_restoring_into_a_different_shape_names_the_path(tmp_path):
  run(tmp_path, "shape", until_step=3)
  with pytest.raises(
      checkpointing.CheckpointError,
      match=r"params/params/decoder/decoder_norm/scale has shape \(64,\), the model expects \(32,\)",
  ):
    _restore_as(tmp_path, "shape", base_emb_dim=32)


def test_restoring_with_a_missing_leaf_names_the_path(tmp_path):
  run(tmp_path, "tied", until_step=3, logits_via_embedding=True)
  with pytest.raises(checkpointing.CheckpointError, match=r"missing: params/params/decoder/logits_dense/kernel"):
    _restore_as(tmp_path, "tied")


def test_checkpoint_has_maxtext_layout(tmp_path):
  run(tmp_path, "layout", until_step=3)
  ckpt = checkpointing.Checkpointer(tmp_path / "layout" / "checkpoints")
  assert (tmp_path / "layout" / "checkpoints" / "3" / "items").is_dir()
  tree = ckpt.manager.item_metadata(3)["items"].tree
  assert set(tree) == {"params", "opt_state", "step"}
  assert tree["step"].dtype == np.int32
  adam, empty, schedule = tree["opt_state"]
  assert empty is None and set(schedule) == {"count"} and set(adam) == {"count", "mu", "nu"}
  assert adam["mu"]["params"]["decoder"]["layers"]["mlp"]["wi_0"]["kernel"].shape == (64, 2, 128)
  assert tree["params"]["params"]["token_embedder"]["embedding"].shape == (256, 64)


def test_nnx_aux_in_a_checkpoint_is_ignored(tmp_path):
  """MaxText's NNX path adds an `nnx_aux` subtree (RNG state); a loader may ignore it."""
  trainer = recipe.create_trainer(tiny_config(NNX))
  state = trainer.init_state(0)
  tree = trainer.to_checkpoint(state)
  tree["nnx_aux"] = {"rngs": {"params": {"key": jnp.zeros((2,), jnp.uint32)}}}
  ckpt = checkpointing.Checkpointer(tmp_path / "aux")
  ckpt.save(1, tree)
  ckpt.wait()
  restored = trainer.from_checkpoint(ckpt.restore(1, trainer.checkpoint_target()))
  chex.assert_trees_all_equal(trainer.params(restored), trainer.params(state))


KILL_MID_SAVE = textwrap.dedent("""
    import os, signal, sys
    from maxbridge.core import checkpointing
    from maxbridge.training import recipe
    import maxbridge as mb
    config = mb.load_config(
        "llama-tiny",
        base_emb_dim=512,
        base_mlp_dim=2048,
        base_num_decoder_layers=4,
        pure_nnx=False,
        enable_nnx=False,
        pure_nnx_decoder=False,
    )
    trainer = recipe.create_trainer(config)
    state = trainer.init_state(0)
    ckpt = checkpointing.Checkpointer(sys.argv[1])
    ckpt.save(1, trainer.to_checkpoint(state))
    ckpt.wait()
    ckpt.save(2, trainer.to_checkpoint(state))
    os.kill(os.getpid(), signal.SIGKILL)  # while step 2 is still being written
    """)


def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
  directory = tmp_path / "ckpt"
  proc = subprocess.run([sys.executable, "-c", KILL_MID_SAVE, str(directory)], capture_output=True)
  assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
  # Killed mid-write: step 2's temporary folder is there, its final name is not.
  names = sorted(os.listdir(directory))
  assert "2" not in names and any(name.startswith("2.") for name in names), f"expected step 2 half-written: {names}"
  ckpt = checkpointing.Checkpointer(directory)
  assert ckpt.all_steps() == [1]
  config = mb.load_config("llama-tiny", base_emb_dim=512, base_mlp_dim=2048, base_num_decoder_layers=4, **LINEN_FLAGS)
  trainer = recipe.create_trainer(config)
  restored = trainer.from_checkpoint(ckpt.restore(1, trainer.checkpoint_target()))
  chex.assert_trees_all_equal(trainer.params(restored), trainer.params(trainer.init_state(0)))


def test_cli_train_writes_the_run_directory(tmp_path, capsys):
  code = cli.main(
      [
          "train",
          "llama-tiny",
          f"base_output_directory={tmp_path}",
          "run_name=cli",
          "steps=2",
          "per_device_batch_size=2",
          "eval_interval=0",
          "log_period=2",
          *LINEN_ARGS,
      ]
  )
  assert code == 0
  out, err = capsys.readouterr()
  assert "step 1 loss" in out
  assert "step 1: loss " in err and "step 0:" not in err  # a metric line every log_period steps
  run_dir = tmp_path / "cli"
  assert (run_dir / "config.yml").exists() and (run_dir / "checkpoints" / "2" / "items").is_dir()
  assert mb.load_config(str(run_dir / "config.yml")).steps == 2


@pytest.mark.parametrize("flags", [LINEN, NNX], ids=["linen", "nnx"])
def test_moe_load_balancing_loss_is_part_of_the_training_loss(flags):
  """The step's loss is cross-entropy plus the sown (already weighted) load-balancing loss."""
  config = mb.load_config(
      "mixtral-tiny",
      pure_nnx=flags[0],
      enable_nnx=flags[1],
      pure_nnx_decoder=flags[2],
      load_balance_loss_weight=0.5,
  )
  batch = data.make_dataset(config, "train", 4).batch(0)
  with_lb = recipe.create_trainer(config)
  without_lb = recipe.create_trainer(config.replace(load_balance_loss_weight=0.0))
  _, metrics = with_lb.train_step(with_lb.init_state(0), batch)
  _, baseline = without_lb.train_step(without_lb.init_state(0), batch)
  assert float(metrics["moe_lb_loss"]) > 0 and float(baseline["moe_lb_loss"]) == 0
  np.testing.assert_allclose(metrics["loss"], baseline["loss"] + metrics["moe_lb_loss"], rtol=1e-6)
