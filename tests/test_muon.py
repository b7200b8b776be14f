"""Muon (opt_type=muon): optax.contrib.muon on canonical matrices; the same on Linen, NNX, scanned and unscanned."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers as Dims

import maxbridge as mb
from maxbridge.core import canonical
from maxbridge.core.config import ConfigError
from maxbridge.training import data, muon, optimizers, recipe
from conftest import tiny_config

LINEN, NNX, MIX = (False, False, False), (True, True, True), (True, False, True)
# (flags, scan_layers): both backends, a bridged mix, scanned and unscanned.
COMBOS = {"linen": (LINEN, False), "linen-scanned": (LINEN, True), "nnx-scanned": (NNX, True), "mix": (MIX, False)}


def muon_config(flags=LINEN, **overrides):
  options = dict(
      opt_type="muon",
      learning_rate=1e-2,
      warmup_steps_fraction=0.0,
      gradient_clipping_threshold=0.0,
      muon_weight_decay=0.1,
      muon_consistent_rms=0.2,
      # AdamW's first steps move a parameter by about lr * g / (|g| + eps): with eps 1e-8 a gradient near zero
      # turns rounding-level differences between two ways of computing it into ~lr-sized ones.
      adam_eps=1e-4,
      steps=6,
      eval_interval=0,
  )
  return tiny_config(flags, **{**options, **overrides})


def _axes(config):
  return canonical.flatten(recipe.create_trainer(config).trainable.trained_axes)


def test_matrices_get_newton_schulz_by_their_logical_axes_and_the_rest_adamw():
  dims = {path: muon.dimension_numbers(path, axes) for path, axes in _axes(muon_config(scan_layers=True)).items()}
  layers = "decoder/layers"
  assert dims[f"{layers}/mlp/wi_0/kernel"] == Dims((0,), (2,))  # [embed, layers, mlp]: the layer axis is a batch axis
  assert dims[f"{layers}/self_attention/query/kernel"] == Dims((0,), (2, 3))  # embed -> heads x head_dim
  assert dims[f"{layers}/self_attention/out/kernel"] == Dims((0, 2), (3,))  # heads x head_dim -> embed
  for path in ("token_embedder/embedding", "decoder/logits_dense/kernel", "decoder/decoder_norm/scale"):
    assert dims[path] is None, path
  assert dims[f"{layers}/pre_self_attention_layer_norm/scale"] is None

  config = mb.load_config("deepseek3-tiny", opt_type="muon")
  moe = "decoder/moe_layers/DeepSeekMoeBlock_0/MoeBlock_0"
  axes = _axes(config)
  dims = {path: muon.dimension_numbers(path, a) for path, a in axes.items()}
  assert dims[f"{moe}/wi_0"] == Dims((2,), (3,))  # [exp, layers, embed, mlp]: one matrix per expert and layer
  assert dims[f"{moe}/wo"] == Dims((2,), (3,))
  assert dims["decoder/moe_layers/self_attention/wkv_b/kernel"] == Dims((0,), (2, 3))  # kv_lora -> heads x (nope+v)
  assert dims[f"{moe}/gate/kernel"] == Dims((0,), (2,)) and dims[f"{moe}/gate/bias"] is None
  assert muon.dimension_numbers(f"{moe}/gate/kernel", axes[f"{moe}/gate/kernel"], include_routers=False) is None


def test_muon_with_lora_is_refused_naming_both_keys():
  with pytest.raises(ConfigError, match="lora_rank > 0 with opt_type=muon"):
    tiny_config(opt_type="muon", lora_rank=4)
  with pytest.raises(ConfigError, match="'opt_type' = 'sgd' is invalid; valid values: 'adamw', 'muon'"):
    tiny_config(opt_type="sgd")


@pytest.fixture(scope="module")
def stepped():
  """Per combination: its trainer, the initial canonical parameters, and the unscanned parameters and losses of
  two steps on one batch."""
  out = {}
  for name, (flags, scan) in COMBOS.items():
    config = muon_config(flags, scan_layers=scan)
    trainer = recipe.create_trainer(config)
    batch = data.make_dataset(config, "train", 4).batch(0)
    state = trainer.init_state(0)
    initial = jax.tree.map(np.asarray, canonical.unstack_layers(trainer.params(state), config.param_scan_axis))
    losses = []
    for _ in range(2):
      state, metrics = trainer.train_step(state, batch)
      losses.append(float(metrics["loss"]))
    params = jax.tree.map(np.asarray, canonical.unstack_layers(trainer.params(state), config.param_scan_axis))
    out[name] = dict(config=config, trainer=trainer, batch=batch, initial=initial, params=params, losses=losses)
  return out


def _hand_dims(params):
  """llama-tiny's unscanned matrices, written out by hand."""

  def dims(path):
    if path.endswith(("mlp/wi_0/kernel", "mlp/wi_1/kernel", "mlp/wo/kernel")):
      return Dims((0,), (1,))
    if path.endswith(("query/kernel", "key/kernel", "value/kernel")):
      return Dims((0,), (1, 2))
    if path.endswith("out/kernel"):
      return Dims((0, 1), (2,))
    return None

  return canonical.unflatten({path: dims(path) for path in canonical.flatten(params)})


def test_a_step_equals_optax_contrib_muon_on_the_same_weights_and_batch(stepped):
  run = stepped["linen"]
  config, batch, model = run["config"], run["batch"], mb.create_model(run["config"], seed=0)

  def loss(params):
    logits = model.apply(params, batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    per_token = -jnp.take_along_axis(log_probs, batch["targets"][..., None], -1)[..., 0]
    mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    return jnp.sum(per_token * mask) / jnp.sum(mask)

  params = jax.tree.map(jnp.asarray, run["initial"])
  tx = optax.contrib.muon(
      optimizers.learning_rate_schedule(config),
      eps=config.adam_eps,
      beta=config.muon_beta,
      weight_decay=config.muon_weight_decay,
      muon_weight_dimension_numbers=_hand_dims(params),
      consistent_rms=0.2,
      adam_b1=config.adam_b1,
      adam_b2=config.adam_b2,
      adam_weight_decay=config.adam_weight_decay,
  )
  opt_state, update, value_and_grad = tx.init(params), jax.jit(tx.update), jax.jit(jax.value_and_grad(loss))
  for step in range(2):
    value, grads = value_and_grad(params)
    np.testing.assert_allclose(run["losses"][step], value, rtol=1e-5)
    updates, opt_state = update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
  moved = 0
  for path, want in canonical.flatten(params).items():
    got = canonical.flatten(run["params"])[path]
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0, err_msg=path)
    moved += not np.allclose(got, canonical.flatten(run["initial"])[path])
  assert moved == len(canonical.flatten(params)), "every parameter should have moved"


@pytest.mark.parametrize("name", ["linen-scanned", "nnx-scanned", "mix"])
def test_scanned_unscanned_linen_nnx_and_bridged_steps_are_equal(stepped, name):
  want, got = canonical.flatten(stepped["linen"]["params"]), canonical.flatten(stepped[name]["params"])
  assert sorted(got) == sorted(want)
  for path, value in want.items():
    np.testing.assert_allclose(got[path], value, atol=1e-6, rtol=0, err_msg=path)
  np.testing.assert_allclose(stepped[name]["losses"], stepped["linen"]["losses"], rtol=1e-6)


def test_muon_trains_and_a_linen_run_resumed_with_nnx_flags_continues_the_same_losses(stepped, tmp_path):
  def run(name, combo, **options):
    config = stepped[combo]["config"].replace(base_output_directory=str(tmp_path), run_name=name)
    return mb.train(config, trainer=stepped[combo]["trainer"], progress=False, **options)

  whole = [r["loss"] for r in run("whole", "linen")]
  assert whole[-1] < whole[0] - 0.05, whole
  run("flip", "linen", until_step=3)
  resumed = run("flip", "mix")  # the bridged NNX state: its optimizer restores Muon's state from Linen's checkpoint
  assert [r["step"] for r in resumed] == [3, 4, 5]
  np.testing.assert_allclose([r["loss"] for r in resumed], whole[3:], rtol=1e-5)


def test_muon_clip_keeps_deepseek_max_logits_near_tau_after_the_first_clip():
  tau = 3.0  # under deepseek3-tiny's initial largest logit (about 4.4)
  config = mb.load_config(
      "deepseek3-tiny",
      opt_type="muon",
      use_qk_clip=True,
      qk_clip_threshold=tau,
      learning_rate=1e-2,
      warmup_steps_fraction=0.0,
      steps=3,
  )
  trainer = recipe.create_trainer(config)
  batch = data.make_dataset(config, "train", 4).batch(0)
  state, maxima = trainer.init_state(0), []
  for _ in range(3):
    state, metrics = trainer.train_step(state, batch)
    maxima.append(float(metrics["maxima"]["max_logits"].max()))
  # Each step measures the logits of the parameters the previous step clipped; they exceed tau only by what one
  # Muon update adds after a clip.
  assert maxima[0] > 1.4 * tau, maxima
  assert max(maxima[1:]) <= 1.1 * tau, maxima
