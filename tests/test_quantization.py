"""Quantization on both backends: AQT int8 training (QAT), the same numbers in every flag combination."""

import shutil

import jax
import numpy as np
import pytest
from flax import nnx

import maxbridge as mb
from maxbridge import checkpointing, dispatch
from maxbridge.config import ConfigError
from conftest import FLAG_COMBINATIONS, flag_id, tiny_config

LINEN = (False, False, False)
NNX = (True, True, True)
TRAIN = dict(steps=30, per_device_batch_size=4, eval_interval=0, checkpoint_period=15)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            dict(quantization="int3"),
            r"'quantization' = 'int3' is invalid; valid values: '', 'int8', 'int4', 'fp8', 'nf4'",
        ),
        (
            dict(quantization="int4"),
            r"'int4' is not supported with use_qwix_quantization=false \(aqt\); valid values: '', 'int8'",
        ),
        (dict(checkpoint_is_quantized=True), r"checkpoint_is_quantized=true needs .* set quantization"),
        (dict(quantization_local_shard_count=-2), r"'quantization_local_shard_count' = -2 is invalid"),
    ],
)
def test_bad_quantization_config_names_the_key_and_the_valid_values(overrides, match):
  with pytest.raises(ConfigError, match=match):
    tiny_config(**overrides)


@pytest.fixture(scope="module")
def float_model():
  return mb.create_model(tiny_config(), seed=0)


@pytest.fixture(scope="module")
def aqt_reference(tokens):
  """Pure Linen AQT int8 logits, scanned and unscanned (the float weights of seed 0)."""
  return {
      scan: np.asarray(mb.create_model(tiny_config(quantization="int8", scan_layers=scan), seed=0).logits(tokens))
      for scan in (True, False)
  }


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS, ids=map(flag_id, FLAG_COMBINATIONS))
def test_aqt_int8_logits_match_pure_linen_in_every_flag_combination(flags, tokens, float_model, aqt_reference):
  model = mb.create_model(tiny_config(flags, quantization="int8"), seed=0)
  # Train mode keeps the float kernels: the canonical tree is the float model's.
  assert model.abstract_params() == float_model.abstract_params()
  logits = np.asarray(model.logits(tokens))
  np.testing.assert_allclose(logits, aqt_reference[True], atol=1e-6, rtol=0, err_msg=flag_id(flags))
  # ...and it is quantized: int8 rounding moves the logits well past float noise.
  assert np.abs(logits - np.asarray(float_model.logits(tokens))).max() > 1e-3


@pytest.mark.parametrize("remat_policy", ["none", "full"])
def test_aqt_int8_unscanned_and_remat_match_between_backends(tokens, aqt_reference, remat_policy):
  for flags in (LINEN, NNX):
    config = tiny_config(flags, quantization="int8", scan_layers=False, remat_policy=remat_policy)
    logits = np.asarray(mb.create_model(config, seed=0).logits(tokens))
    np.testing.assert_allclose(logits, aqt_reference[False], atol=1e-6, rtol=0, err_msg=f"{flag_id(flags)}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """30 steps of float and of AQT int8 (Linen), and the int8 run's step-15 checkpoint resumed in NNX."""
  root = tmp_path_factory.mktemp("runs")

  def run(name, flags, **overrides):
    config = tiny_config(flags, base_output_directory=str(root), run_name=name, **TRAIN, **overrides)
    return [r["loss"] for r in mb.train(config, progress=False)]

  losses = dict(float=run("float", LINEN), int8=run("int8", LINEN, quantization="int8"))
  shutil.copytree(root / "int8", root / "flip")
  shutil.rmtree(root / "flip" / "checkpoints" / "30")
  losses["resumed"] = run("flip", NNX, quantization="int8")
  return dict(root=root, **losses)


def test_aqt_int8_training_learns_and_ends_within_5_percent_of_float(runs):
  float_losses, int8_losses = runs["float"], runs["int8"]
  assert int8_losses[-1] < int8_losses[0] - 1.0, f"int8 QAT should learn: {int8_losses}"
  assert abs(int8_losses[-1] / float_losses[-1] - 1) < 0.05, (int8_losses[-1], float_losses[-1])
  assert int8_losses != float_losses, "quantization changed nothing"


def test_linen_aqt_run_resumed_in_nnx_continues_the_same_losses(runs):
  assert len(runs["resumed"]) == 15
  np.testing.assert_allclose(runs["resumed"], runs["int8"][15:], rtol=1e-5)


def test_aqt_state_and_checkpoints_hold_no_intermediates(runs):
  float_trainer = dispatch.create_trainer(tiny_config())
  for flags in (LINEN, NNX):
    trainer = dispatch.create_trainer(tiny_config(flags, quantization="int8"))
    assert trainer.disk_layout == float_trainer.disk_layout, flag_id(flags)
  nnx_state = dispatch.create_trainer(tiny_config(NNX, quantization="int8")).abstract_state()
  assert not nnx.state(nnx_state, nnx.Intermediate), "sown values in the NNX train state"
  ckpt = checkpointing.Checkpointer(runs["root"] / "int8" / "checkpoints")
  saved = ckpt.restore(30, jax.tree.map(lambda x: x, float_trainer.checkpoint_target()))
  ckpt.close()
  assert set(saved) == {"params", "opt_state", "step"} and set(saved["params"]) == {"params"}
