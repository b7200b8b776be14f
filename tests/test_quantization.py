"""Quantization on both backends: AQT int8 training (QAT), the same numbers in every flag combination."""

import shutil

import jax
import numpy as np
import pytest
from flax import nnx

import maxbridge as mb
from maxbridge import canonical, checkpointing, dispatch
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


# --- Qwix QAT -------------------------------------------------------------------


def qwix_config(flags, quantization, **overrides):
  return tiny_config(flags, quantization=quantization, use_qwix_quantization=True, **overrides)


@pytest.mark.parametrize(
    "quantization,overrides",
    [
        ("int8", {}),
        ("int4", dict(scan_layers=False)),
        ("fp8", dict(remat_policy="full")),
        ("fp8", dict(remat_policy="full", scan_layers=False)),
    ],
    ids=["int8", "int4-unscanned", "fp8-remat", "fp8-remat-unscanned"],
)
def test_qwix_logits_and_gradients_match_between_linen_and_nnx(quantization, overrides, tokens, float_model):
  results = []
  float_params = mb.create_model(tiny_config(**overrides), seed=0).abstract_params()
  for flags in (LINEN, NNX):
    model = mb.create_model(qwix_config(flags, quantization, **overrides), seed=0)
    assert model.abstract_params() == float_params, "QAT adds no parameters"
    loss = lambda params: model.apply(params, tokens).std()  # noqa: E731
    results.append(jax.jit(jax.value_and_grad(lambda p: (loss(p), model.apply(p, tokens)), has_aux=True))(model.params()))
  ((_, linen_logits), linen_grads), ((_, nnx_logits), nnx_grads) = results
  np.testing.assert_allclose(nnx_logits, linen_logits, atol=1e-6, rtol=0)
  linen_grads, nnx_grads = canonical.flatten(linen_grads), canonical.flatten(nnx_grads)
  assert set(nnx_grads) == set(linen_grads)
  for path, grad in linen_grads.items():
    np.testing.assert_allclose(nnx_grads[path], grad, atol=1e-6, rtol=0, err_msg=path)
  assert np.abs(np.asarray(linen_logits) - np.asarray(float_model.logits(tokens))).max() > 1e-3


def test_qwix_nnx_model_holds_no_intermediates_after_its_setup_pass():
  model = mb.create_model(qwix_config(NNX, "int8"), seed=0)
  assert not nnx.state(model.module, nnx.Intermediate), "Qwix's setup forward pass left sown values"
  assert set(type(v).__name__ for _, v in nnx.to_flat_state(nnx.state(model.module))) == {"Param"}


def test_a_float_model_built_after_a_quantized_one_gives_the_same_float_logits(tokens):
  for flags in (LINEN, NNX):
    before = np.asarray(mb.create_model(tiny_config(flags), seed=0).logits(tokens))
    mb.create_model(qwix_config(flags, "int8"), seed=0).logits(tokens)
    after = np.asarray(mb.create_model(tiny_config(flags), seed=0).logits(tokens))
    np.testing.assert_array_equal(after, before, err_msg=flag_id(flags))


def test_qwix_with_mixed_flags_is_refused_with_the_reason():
  with pytest.raises(
      ConfigError, match=r"use_qwix_quantization=true needs pure Linen or pure NNX.*got false, true, true"
  ):
    qwix_config((False, True, True), "int8")


@pytest.fixture(scope="module")
def qwix_runs(tmp_path_factory, runs):
  """30 steps: Qwix int8 in Linen (its step-15 checkpoint resumed in NNX), int4 and fp8 (remat) in NNX."""
  root = tmp_path_factory.mktemp("qwix")

  def run(name, flags, quantization, **overrides):
    config = qwix_config(flags, quantization, base_output_directory=str(root), run_name=name, **TRAIN, **overrides)
    return [r["loss"] for r in mb.train(config, progress=False)]

  losses = dict(int8=run("int8", LINEN, "int8"))
  shutil.copytree(root / "int8", root / "flip")
  shutil.rmtree(root / "flip" / "checkpoints" / "30")
  losses["resumed"] = run("flip", NNX, "int8")
  losses["int4"] = run("int4", NNX, "int4")
  losses["fp8"] = run("fp8", NNX, "fp8", remat_policy="full")
  return dict(float=runs["float"], **losses)


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_qwix_training_learns_and_ends_within_5_percent_of_float(qwix_runs, quantization):
  losses, float_losses = qwix_runs[quantization], qwix_runs["float"]
  assert losses[-1] < losses[0] - 1.0, f"Qwix {quantization} QAT should learn: {losses}"
  assert abs(losses[-1] / float_losses[-1] - 1) < 0.05, (losses[-1], float_losses[-1])


def test_linen_qwix_run_resumed_in_nnx_continues_the_same_losses(qwix_runs):
  np.testing.assert_allclose(qwix_runs["resumed"], qwix_runs["int8"][15:], rtol=1e-5)
