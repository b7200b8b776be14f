"""QK-Clip on canonical parameters: per layer, per head, scanned == unscanned, unclipped heads untouched."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxbridge as mb
from maxbridge.core import canonical
from maxbridge.training import data, qk_clip
from maxbridge.core.config import ConfigError
from maxbridge.training import recipe
from conftest import LINEN_FLAGS


def _maxima(config, low=0.5, high=3.0):
  """Per stack [layers, heads], distinct per layer so that a shared scale would show."""
  heads = config.num_query_heads
  return {s: jnp.linspace(low, high, n * heads).reshape(n, heads) for s, n in canonical.layer_stacks(config)}


@pytest.mark.parametrize("preset", ["llama-tiny", "deepseek3-tiny", "gpt3-tiny"])
def test_scanned_and_unscanned_clip_identically_per_layer(preset):
  config = dataclasses.replace(mb.load_config(preset, **LINEN_FLAGS), qk_clip_threshold=1.0)
  params = mb.create_model(config, seed=0).params()
  maxima = _maxima(config)
  scanned = canonical.unstack_layers(qk_clip.clip(params, maxima, config), config.param_scan_axis)
  unstacked = canonical.unstack_layers(params, config.param_scan_axis)
  unscanned = qk_clip.clip(unstacked, maxima, config)
  for path, value in canonical.flatten(unscanned).items():
    np.testing.assert_array_equal(canonical.flatten(scanned)[path], value, err_msg=path)


def test_llama_query_heads_scale_by_tau_over_max_and_the_rest_is_bit_identical():
  config = dataclasses.replace(mb.load_config("llama-tiny", scan_layers=False, **LINEN_FLAGS), qk_clip_threshold=1.0)
  params = mb.create_model(config, seed=0).params()
  maxima = _maxima(config)
  clipped = canonical.flatten(qk_clip.clip(params, maxima, config))
  before = canonical.flatten(params)
  for path, value in before.items():
    if not path.endswith("self_attention/query/kernel"):
      np.testing.assert_array_equal(clipped[path], value, err_msg=path)
      continue
    layer = int(path.split("/")[1].removeprefix("layers_"))
    top = np.asarray(maxima["layers"][layer])
    for head in range(config.num_query_heads):
      got, was = clipped[path][:, head], value[:, head]
      if top[head] <= 1.0:
        np.testing.assert_array_equal(got, was, err_msg=f"{path} head {head} is under tau")
      else:
        np.testing.assert_allclose(got, was / top[head], rtol=1e-6, err_msg=f"{path} head {head}")


def test_mla_scales_nope_by_sqrt_and_rope_by_s_and_leaves_values():
  config = dataclasses.replace(mb.load_config("deepseek3-tiny", scan_layers=False, **LINEN_FLAGS), qk_clip_threshold=1.0)
  params = mb.create_model(config, seed=0).params()
  maxima = {s: jnp.full((n, config.num_query_heads), 4.0) for s, n in canonical.layer_stacks(config)}
  clipped = canonical.flatten(qk_clip.clip(params, maxima, config))
  before = canonical.flatten(params)
  nope = config.qk_nope_head_dim
  query = [p for p in before if p.endswith(("self_attention/wq_b/kernel", "self_attention/query/kernel"))][0]
  np.testing.assert_allclose(clipped[query][..., :nope], before[query][..., :nope] * 0.5, rtol=1e-6)
  np.testing.assert_allclose(clipped[query][..., nope:], before[query][..., nope:] * 0.25, rtol=1e-6)
  kv = query.rsplit("/", 2)[0] + "/wkv_b/kernel"
  np.testing.assert_allclose(clipped[kv][..., :nope], before[kv][..., :nope] * 0.5, rtol=1e-6)
  np.testing.assert_array_equal(clipped[kv][..., nope:], before[kv][..., nope:])  # values


def test_qk_norm_refuses_qk_clip_when_the_config_loads_with_the_reason():
  with pytest.raises(ConfigError, match="use_qk_norm=true: the query/key RMSNorm undoes"):
    mb.load_config("qwen3-tiny", use_qk_clip=True)


# --- through the model and the train step ----------------------------------

TAU = 0.05  # below the tiny models' initial logits, so every step clips


def _qk_config(preset, flags=(False, False, False), **overrides):
  pure_nnx, enable_nnx, decoder = flags
  overrides = {"use_qk_clip": True, "qk_clip_threshold": TAU, **overrides}
  return mb.load_config(preset, pure_nnx=pure_nnx, enable_nnx=enable_nnx, pure_nnx_decoder=decoder, **overrides)


def _max_logits(model, params, tokens):
  return np.asarray(model.apply_with_intermediates(params, tokens)[1]["decoder/max_logits"])


@pytest.mark.parametrize("preset", ["llama-tiny", "deepseek3-tiny", "gpt3-tiny"])
def test_after_clipping_every_clipped_head_peaks_at_tau_and_the_others_are_unchanged(preset, tokens):
  # One layer: a clip in one layer changes what every later layer sees, so only
  # a single layer's logits are exactly predictable after the clip.
  one_layer = {"first_num_dense_layers": 0} if preset == "deepseek3-tiny" else {}
  model = mb.create_model(_qk_config(preset, base_num_decoder_layers=1, **one_layer), seed=0)
  config, params = model.config, model.params()
  before = _max_logits(model, params, tokens)
  # Tau at the median head: some heads exceed it and some do not.
  config_small = dataclasses.replace(config, qk_clip_threshold=float(np.median(before)))
  clipped = qk_clip.after_update(params, {"maxima": {"max_logits": jnp.asarray(before)}}, config=config_small)
  after = _max_logits(model, clipped, tokens)
  tau = config_small.qk_clip_threshold
  over = before > tau
  assert over.any() and (~over).any()
  np.testing.assert_allclose(after[over], tau, rtol=1e-4)
  np.testing.assert_array_equal(after[~over], before[~over])


@pytest.mark.parametrize("preset", ["llama-tiny", "deepseek3-tiny"])
def test_a_run_with_qk_clip_stays_bounded_where_the_same_run_without_exceeds_tau(preset, tmp_path):
  def run(threshold, name):
    config = _qk_config(
        preset,
        qk_clip_threshold=threshold,
        steps=4,
        learning_rate=3e-2,
        eval_interval=0,
        enable_checkpointing=False,
        run_name=name,
        base_output_directory=str(tmp_path),
    )
    return [record["max_logits"] for record in mb.train(config, progress=False)]

  tau = {"llama-tiny": 5.0, "deepseek3-tiny": 4.5}[preset]  # just above the initial logits
  clipped = run(tau, "clipped")
  unclipped = run(1e9, "unclipped")  # the hook runs but never clips
  assert max(unclipped) > tau, unclipped
  # Each step's maximum is measured before that step's clip: once the first clip
  # has happened (step 1), it stays within about one optimizer step's growth of
  # tau, and ends below the unclipped run.
  one_step = max(b - a for a, b in zip(unclipped, unclipped[1:]))
  assert max(clipped[2:]) < tau + 2 * one_step, (clipped, unclipped)
  assert clipped[-1] < unclipped[-1], (clipped, unclipped)


@pytest.fixture(scope="module")
def tokens():
  return jax.random.randint(jax.random.key(1), (2, 16), 0, 256)


def _one_step(config):
  trainer = recipe.create_trainer(config)
  batch = data.make_dataset(config, "train", 4).batch(0)
  state, metrics = trainer.train_step(trainer.init_state(0), batch)
  return canonical.unstack_layers(trainer.params(state), config.param_scan_axis), metrics


@pytest.mark.parametrize("preset", ["llama-tiny", "deepseek3-tiny"])
def test_clipped_step_is_the_same_on_linen_nnx_scanned_and_unscanned(preset):
  want, metrics = _one_step(_qk_config(preset))
  assert float(metrics["maxima"]["max_logits"].max()) > TAU
  for flags, scan in (((True, True, True), True), ((False, False, False), False), ((True, True, True), False)):
    got, _ = _one_step(_qk_config(preset, flags, scan_layers=scan))
    for path, value in canonical.flatten(want).items():
      np.testing.assert_allclose(canonical.flatten(got)[path], value, atol=1e-6, rtol=0, err_msg=f"{flags} {scan} {path}")
