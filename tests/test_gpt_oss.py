"""gpt-oss (decoder_block gpt_oss) on both backends: against transformers, and with every feature.

A tiny random GptOssForCausalLM of two blocks (4 layers) is saved by
transformers and imported: our logits match its logits, 24 greedy tokens match
its `generate` (and mb.Engine's), export-hf round-trips. Its window (4) is
shorter than the test sequences, its sinks and biases are random, its
swiglu_limit small enough to clamp, and its RoPE is YaRN: each feature, taken
away, moves the logits past the tolerance. YaRN's frequencies are checked
against transformers' own `_compute_yarn_parameters`.
"""

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge import cli  # noqa: E402
from maxbridge.core import canonical  # noqa: E402
from maxbridge.core.config import ConfigError  # noqa: E402
from maxbridge.interop import hf, pretrained  # noqa: E402
from maxbridge.ops import rotary  # noqa: E402
from maxbridge.training import data, recipe  # noqa: E402
from test_hf import LOGITS_TOL, max_diff, randomize  # noqa: E402
from test_vocab_tiling import _assert_grads_close, _batch, _grads  # noqa: E402

PRESET = "gpt-oss-tiny"
LINEN, NNX = (False, False, False), (True, True, True)
NEW_TOKENS = 24
PROMPT = np.array([[3, 17, 250, 42, 9], [100, 1, 77, 200, 31]], np.int64)
TOKENS = np.random.default_rng(0).integers(0, 256, (2, 12))
WINDOW = 4
YARN = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}
DIMS = dict(
    hidden_size=64,
    num_hidden_layers=4,
    vocab_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    swiglu_limit=0.5,  # below the gate's and up projection's spread: the clamp bites
    max_position_embeddings=256,
    initializer_range=0.1,
    rope_parameters=YARN,
)


@pytest.fixture(autouse=True)
def highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


def family_config(flags, **overrides) -> mb.Config:
  pure_nnx, enable_nnx, pure_nnx_decoder = flags
  return mb.load_config(PRESET, pure_nnx=pure_nnx, enable_nnx=enable_nnx, pure_nnx_decoder=pure_nnx_decoder, **overrides)


class Saved:
  """A tiny random gpt-oss saved by transformers, with its logits and greedy continuation."""

  def __init__(self, folder, generate: bool = True, **changes):
    torch.manual_seed(0)
    self.model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**{**DIMS, **changes})).eval()
    randomize(self.model)
    self.folder = folder
    self.model.save_pretrained(folder)
    with torch.no_grad():
      self.logits = self.model(torch.tensor(TOKENS)).logits.numpy()
      if generate:
        self.continuation = self.model.generate(
            torch.tensor(PROMPT), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        ).numpy()
    assert np.std(self.logits) > 0.1, "logits too flat to tell a wrong mapping from a right one"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return Saved(tmp_path_factory.mktemp("gpt_oss") / "hf")


# --- Hugging Face -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend, scan_layers",
    [("linen", True), ("nnx", False), ("nnx", True)],
    ids=["linen-scanned", "nnx-unscanned", "nnx-scanned"],
)
def test_imported_logits_and_24_greedy_tokens_match_transformers(reference, backend, scan_layers):
  model = mb.from_pretrained(reference.folder, backend=backend, scan_layers=scan_layers)
  cfg = model.config
  assert (cfg.decoder_block, cfg.num_decoder_layers, cfg.sliding_window_size, cfg.rope_type) == (
      "gpt_oss",
      4,
      WINDOW,
      "yarn",
  )
  if scan_layers:  # two blocks stacked: one scan, no loop over layers
    assert model.params()["decoder"]["layers"]["global"]["MoeBlock_0"]["wi"].shape[cfg.param_scan_axis] == 2
  assert max_diff(model.logits(jnp.asarray(TOKENS, jnp.int32)), reference.logits) <= LOGITS_TOL
  np.testing.assert_array_equal(np.asarray(model.generate(PROMPT, max_new_tokens=NEW_TOKENS)), reference.continuation)
  # The same tokens through mb.Engine, both prompts in two decode slots.
  engine = mb.Engine(cfg.replace(per_device_batch_size=2, max_prefill_predict_length=8), model=model)
  state = engine.init_decode_state()
  for slot, prompt in enumerate(PROMPT):
    state = engine.insert(engine.prefill(prompt), state, slot)
  first = np.asarray(state.tokens)[:, None]
  state, tokens = engine.generate_steps(state, NEW_TOKENS - 1)
  np.testing.assert_array_equal(np.concatenate([first, tokens], axis=1), reference.continuation[:, PROMPT.shape[1] :])


def _without(params, cfg, leaf: str, value):
  """`params` with every layer's `leaf` (a path under a sub-layer) set to `value`."""
  flat = canonical.flatten(params)
  changed = {path: (jnp.full_like(x, value) if path.endswith(leaf) else x) for path, x in flat.items()}
  assert changed.keys() == flat.keys() and any(path.endswith(leaf) for path in flat), leaf
  return canonical.unflatten(changed)


@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_sinks_and_biases_each_change_the_logits(reference, backend):
  model = mb.from_pretrained(reference.folder, backend=backend)
  params = model.params()
  for leaf, value in (("self_attention/sinks", -1e9), ("self_attention/query/bias", 0.0), ("MoeBlock_0/wo_bias", 0.0)):
    logits = model.apply(_without(params, model.config, leaf, value), jnp.asarray(TOKENS, jnp.int32))
    assert max_diff(logits, reference.logits) > 100 * LOGITS_TOL, leaf


@pytest.mark.parametrize(
    "change",
    [
        {"sliding_window": 64},  # a window covering the sequence
        {"swiglu_limit": 7.0},  # a clamp the projections never reach
        {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},  # no YaRN
    ],
    ids=["window", "clamp", "yarn"],
)
def test_each_feature_changes_the_result_as_transformers_computes_it(reference, tmp_path, change):
  other = Saved(tmp_path / "hf", generate=False, **change)
  assert max_diff(other.logits, reference.logits) > 100 * LOGITS_TOL
  model = mb.from_pretrained(other.folder, backend="linen")
  assert max_diff(model.logits(jnp.asarray(TOKENS, jnp.int32)), other.logits) <= LOGITS_TOL


@pytest.mark.parametrize(
    "parameters",
    [
        YARN,
        {**YARN, "truncate": True, "factor": 8.0, "beta_fast": 16.0, "original_max_position_embeddings": 64},
        {**YARN, "rope_theta": 10000.0, "beta_slow": 2.0, "original_max_position_embeddings": 128},
    ],
)
def test_yarn_frequencies_and_attention_factor_are_transformers(parameters):
  from transformers.modeling_rope_utils import _compute_yarn_parameters

  config = transformers.GptOssConfig(**{**DIMS, "rope_parameters": dict(parameters)})
  inv_freq, factor = _compute_yarn_parameters(config)
  scaling = rotary.YarnScaling(
      parameters["factor"],
      parameters["beta_fast"],
      parameters["beta_slow"],
      parameters["original_max_position_embeddings"],
      parameters["rope_theta"],
      parameters["truncate"],
  )
  head_dim = DIMS["head_dim"]
  timescale = parameters["rope_theta"] ** (2 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim)
  np.testing.assert_allclose(1.0 / np.asarray(scaling(timescale)), inv_freq.numpy(), rtol=1e-6)
  assert scaling.attention_factor == pytest.approx(factor, rel=1e-12)


def test_export_loads_in_transformers_and_reimports_the_same_tree(reference, tmp_path):
  assert cli.main(["import-hf", str(reference.folder), str(tmp_path / "ckpt")]) == 0
  assert cli.main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "exported")]) == 0
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
  assert type(exported) is transformers.GptOssForCausalLM
  assert exported.config.layer_types == reference.model.config.layer_types
  assert exported.config.rope_parameters["rope_type"] == "yarn"
  with torch.no_grad():
    assert max_diff(exported(torch.tensor(TOKENS)).logits.numpy(), reference.logits) <= 1e-5
  assert cli.main(["import-hf", str(tmp_path / "exported"), str(tmp_path / "again"), "--scan-layers", "false"]) == 0
  _, first = pretrained.load_checkpoint(tmp_path / "ckpt")
  _, again = pretrained.load_checkpoint(tmp_path / "again")
  first = canonical.flatten(canonical.unstack_layers(first, 1) if canonical.is_scanned(first) else first)
  again = canonical.flatten(again)
  assert sorted(first) == sorted(again)
  assert "decoder/layers_1/global/self_attention/sinks" in first  # Hugging Face's layer 3
  for path in first:
    np.testing.assert_array_equal(first[path], again[path], err_msg=path)


@pytest.fixture(scope="module")
def saved_config(reference):
  return json.loads((reference.folder / "config.json").read_text())


def test_absent_rope_reads_as_gptossconfigs_yarn(saved_config):
  cfg = hf.config_from_hf({**saved_config, "rope_parameters": None})
  want = transformers.GptOssConfig(**{**DIMS, "rope_parameters": None}).rope_parameters
  assert (cfg.rope_type, cfg.rope_factor, cfg.original_max_position_embeddings, cfg.rope_truncate) == (
      "yarn",
      want["factor"],
      want["original_max_position_embeddings"],
      want["truncate"],
  )
  assert cfg.rope_max_timescale == 150000


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            {"layer_types": ["full_attention", "sliding_attention"] * 2},
            r"layer_types=.* is not supported; maxbridge's gpt_oss",
        ),
        ({"num_hidden_layers": 3, "layer_types": None}, r"num_hidden_layers=3 with layer_types="),
        ({"sliding_window": None}, r"sliding_window=None must be a positive integer"),
        ({"swiglu_alpha": 1.0}, r"swiglu_alpha=1.0 is not supported"),
        ({"attention_bias": False}, r"attention_bias=False is not supported"),
        ({"rope_parameters": {**YARN, "mscale": 1.0}}, r"rope_parameters.mscale=1.0 is not supported"),
        ({"rope_parameters": {**YARN, "rope_type": "llama3"}}, r"rope_parameters.rope_type='llama3' is not supported"),
    ],
)
def test_configs_gpt_oss_cannot_compute_are_refused_naming_the_field(saved_config, edit, match):
  with pytest.raises(hf.HFError, match=match):
    hf.config_from_hf({**saved_config, **edit})


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(use_qk_clip=True), r"use_qk_clip=true with decoder_block='gpt_oss'"),
        (dict(sliding_window_size=0), r"decoder_block='gpt_oss' alternates .* sliding_window_size > 0"),
        (dict(base_num_decoder_layers=3), r"base_num_decoder_layers=3 must be even"),
        (dict(rope_type="llama3.1"), r"rope_type='llama3.1' must be yarn or default"),
        (dict(num_experts=1, num_experts_per_tok=1), r"num_experts must be >= 2"),
    ],
)
def test_bad_gpt_oss_settings_are_refused_with_the_reason(overrides, match):
  with pytest.raises(ConfigError, match=match):
    mb.load_config(PRESET, **overrides)


@pytest.mark.parametrize("preset", ["gpt-oss-20b", "gpt-oss-120b"])
def test_real_size_presets_build_abstractly(preset):
  model = mb.create_model(mb.load_config(preset), seed=0)
  flat = canonical.flatten(model.abstract_params())
  count = sum(int(np.prod(leaf.shape)) for leaf in flat.values())
  # transformers' counts for the two models: 20.9B and 116.8B parameters.
  assert count == pytest.approx({"gpt-oss-20b": 20.9e9, "gpt-oss-120b": 116.8e9}[preset], rel=0.01)


# --- features -------------------------------------------------------------------------------------


def test_vocab_tiling_gives_the_untiled_loss_and_gradients_on_both_backends():
  untiled = family_config(LINEN)
  batch = _batch(untiled)
  want_loss, want = _grads(untiled, batch)
  for flags in (LINEN, NNX):
    loss, grads = _grads(family_config(flags, num_vocab_tiling=4), batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    _assert_grads_close(grads, want, rtol=1e-5)


def _steps(config, steps=3):
  trainer = recipe.create_trainer(config)
  state = trainer.init_state(0)
  dataset = data.make_dataset(config, "train", config.per_device_batch_size)
  before = jax.device_get(trainer.params(state))
  losses = []
  for step in range(steps):
    state, metrics = trainer.train_step(state, trainer.shard_batch(dataset.batch(step, 0, 1)))
    losses.append(float(metrics["loss"]))
  return losses, before, jax.device_get(trainer.params(state)), jax.device_get(trainer.trained_params(state))


@pytest.mark.parametrize("flags", [LINEN, NNX], ids=["linen", "nnx"])
def test_lora_trains_its_adapters_and_leaves_the_base_alone(flags):
  config = family_config(flags, lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, per_device_batch_size=2)
  losses, before, after, adapters = _steps(config)
  assert losses[-1] < losses[0]
  adapted = [path for path in canonical.flatten(adapters) if path.endswith("_lora_a")]
  assert any("/local/" in path for path in adapted) and any("/global/" in path for path in adapted), adapted
  for path, leaf in canonical.flatten(before).items():
    np.testing.assert_array_equal(canonical.flatten(after)[path], leaf, err_msg=path)


def test_aqt_int8_runs_alike_on_both_backends_and_stays_near_float():
  def logits(flags, **overrides):
    return np.asarray(mb.create_model(family_config(flags, **overrides), seed=0).logits(TOKENS))

  float_logits = logits(LINEN)
  linen, nnx = logits(LINEN, quantization="int8"), logits(NNX, quantization="int8")
  np.testing.assert_allclose(nnx, linen, rtol=1e-5, atol=1e-5)
  assert 0 < max_diff(linen, float_logits) < 0.1 * float(np.max(np.abs(float_logits)))


# --- 8 devices ------------------------------------------------------------------------------------


def test_training_on_8_devices_over_fsdp_tensor_and_expert_matches_one_device():
  script = Path(__file__).parent / "gpt_oss_multidevice.py"
  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  report = json.loads(proc.stdout)
  assert report["devices"] == 8
  for backend in ("linen", "nnx"):
    np.testing.assert_allclose(report[f"{backend}@1x2x2x2"], report[f"{backend}@1"], rtol=1e-4)
    np.testing.assert_allclose(report[f"{backend}@1"], report["linen@1"], rtol=1e-6)
    # [experts, D, 2F] over expert=2 and fsdp=2 (D), tensor=2 (2F): an eighth of it on each device.
    shards = report[f"{backend}/wi_shards"]
    assert shards and all(np.prod(shard) * 8 == np.prod(full) and shard[0] * 2 == full[0] for full, shard in shards)
