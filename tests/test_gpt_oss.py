"""gpt-oss (decoder_block gpt_oss) on both backends: against transformers, and with every feature.

A tiny random GptOssForCausalLM of two blocks (4 layers) is saved by
transformers and imported: our logits match its logits, 24 greedy tokens match
its `generate` (and mb.Engine's), export-hf round-trips. Its window (4) is
shorter than the test sequences, its sinks and biases are random, its
swiglu_limit small enough to clamp, and its RoPE is YaRN: each feature, taken
away, moves the logits past the tolerance. YaRN's frequencies are checked
against transformers' own `_compute_yarn_parameters`. Its 8-device training is
checked with the other newer families' in test_families_multidevice.py.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge.core import canonical  # noqa: E402
from maxbridge.core.config import ConfigError  # noqa: E402
from maxbridge.interop import hf  # noqa: E402
from maxbridge.models import dispatch  # noqa: E402
from maxbridge.ops import rotary  # noqa: E402
from test_hf import LOGITS_TOL, max_diff  # noqa: E402
from conftest import LINEN  # noqa: E402
from hf_family import NNX, TOKENS, Saved, assert_matches_transformers, assert_same_tree  # noqa: E402
from hf_family import export_and_reimport, family_config  # noqa: E402
from hf_family import int8_logits, train_steps  # noqa: E402
from hf_family import TINY  # noqa: E402
from hf_family import highest_precision  # noqa: E402,F401 (an autouse fixture)

PRESET = "gpt-oss-tiny"
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
    **TINY,
    num_hidden_layers=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=WINDOW,
    swiglu_limit=0.5,  # below the gate's and up projection's spread: the clamp bites
    max_position_embeddings=256,
    rope_parameters=YARN,
)


def saved(folder, generate: bool = True, **changes) -> Saved:
  """A tiny random GptOss saved by transformers, with its logits and greedy continuation."""
  torch.manual_seed(0)
  config = transformers.GptOssConfig(**{**DIMS, **changes})
  return Saved(transformers.GptOssForCausalLM(config), folder, generate=generate)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return saved(tmp_path_factory.mktemp("gpt_oss") / "hf")


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
  assert_matches_transformers(model, reference)


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
  other = saved(tmp_path / "hf", generate=False, **change)
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
  exported, first, again = export_and_reimport(reference, tmp_path, transformers.GptOssForCausalLM)
  assert exported.config.layer_types == reference.model.config.layer_types
  assert exported.config.rope_parameters["rope_type"] == "yarn"
  assert "decoder/layers_1/global/self_attention/sinks" in first  # Hugging Face's layer 3
  assert_same_tree(first, again)


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
  # abstract_model, not create_model: no initialiser is compiled for (or run on) 21B-117B parameters.
  flat = canonical.flatten(dispatch.abstract_model(mb.load_config(preset)).abstract_params())
  count = sum(int(np.prod(leaf.shape)) for leaf in flat.values())
  # transformers' counts for the two models: 20.9B and 116.8B parameters.
  assert count == pytest.approx({"gpt-oss-20b": 20.9e9, "gpt-oss-120b": 116.8e9}[preset], rel=0.01)


# --- features -------------------------------------------------------------------------------------


@pytest.mark.parametrize("flags", [LINEN, NNX], ids=["linen", "nnx"])
def test_lora_trains_its_adapters_and_leaves_the_base_alone(flags):
  config = family_config(PRESET, flags, lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, per_device_batch_size=2)
  losses, before, after, adapters = train_steps(config)
  assert losses[-1] < losses[0]
  adapted = [path for path in canonical.flatten(adapters) if path.endswith("_lora_a")]
  assert any("/local/" in path for path in adapted) and any("/global/" in path for path in adapted), adapted
  for path, leaf in canonical.flatten(before).items():
    np.testing.assert_array_equal(canonical.flatten(after)[path], leaf, err_msg=path)


def test_aqt_int8_runs_alike_on_both_backends_and_stays_near_float():
  # One block: in a deeper random stack any rounding flips some routing (at 4 layers int8 moves the logits
  # by 0.74 of 3.96, as Qwix did with only its router quantized); one block moves them by 0.09 of 3.63.
  float_logits, linen, nnx = int8_logits(PRESET, base_num_decoder_layers=2)
  np.testing.assert_allclose(nnx, linen, rtol=1e-5, atol=1e-5)
  assert 0 < max_diff(linen, float_logits) < 0.1 * float(np.max(np.abs(float_logits)))
