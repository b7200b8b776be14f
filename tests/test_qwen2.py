"""Qwen2 / Qwen2.5 (decoder_block qwen2): Llama's layer with query, key and value biases, against transformers.

The reference is a tiny random `Qwen2ForCausalLM` (no download), every bias
random and far from zero, so a bias dropped, put on the out projection, or not
scaled as attention scales the queries changes the logits. Linen/NNX parity in
every flag mix is tests/test_families.py's (qwen2.5-tiny is one of its FAMILIES);
its tied head and every config field are test_hf_fields.py's.
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
from maxbridge.training import qk_clip  # noqa: E402
from hf_family import TINY, Saved, assert_matches_transformers, assert_same_tree, export_and_reimport  # noqa: E402
from hf_family import highest_precision  # noqa: E402,F401 (an autouse fixture)

DIMS = dict(**TINY, num_hidden_layers=2, num_key_value_heads=2, intermediate_size=128, rms_norm_eps=1e-6)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """A saved tiny untied Qwen2 (as Qwen2.5 7B and 14B) and what transformers computes with it."""
  torch.manual_seed(0)
  config = transformers.Qwen2Config(**DIMS, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
  return Saved(transformers.Qwen2ForCausalLM(config), tmp_path_factory.mktemp("qwen2") / "hf")


@pytest.mark.parametrize("backend, scan_layers", [("linen", True), ("nnx", False)])
def test_imported_logits_and_a_24_token_greedy_continuation_match_transformers(reference, backend, scan_layers):
  model = mb.from_pretrained(reference.folder, backend=backend, scan_layers=scan_layers)
  cfg = model.config
  assert (cfg.decoder_block, cfg.rope_max_timescale, cfg.logits_via_embedding) == ("qwen2", 1000000, False)
  flat = canonical.flatten(model.params())
  layer = "decoder/layers" if scan_layers else "decoder/layers_0"
  assert np.std(np.asarray(flat[f"{layer}/self_attention/query/bias"])) > 0.1  # random biases, read
  assert f"{layer}/self_attention/out/bias" not in flat
  assert_matches_transformers(model, reference)


def test_export_loads_in_transformers_and_reimports_the_same_tree(reference, tmp_path):
  exported, first, again = export_and_reimport(reference, tmp_path, transformers.Qwen2ForCausalLM)
  assert exported.config.use_sliding_window is False
  for name in ("query", "key", "value"):
    assert f"decoder/layers_1/self_attention/{name}/bias" in first
  assert_same_tree(first, again)


@pytest.fixture(scope="module")
def saved_config(reference):
  return json.loads((reference.folder / "config.json").read_text())


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1, "layer_types": None},
            r"use_sliding_window=true with max_window_layers=1 gives layers \[1\] a sliding window; maxbridge's qwen2",
        ),
        ({"layer_types": ["sliding_attention", "full_attention"]}, r"layer_types gives layers \[0\] a sliding window"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ],
)
def test_configs_qwen2_cannot_compute_are_refused_naming_the_field(saved_config, edit, match):
  with pytest.raises(hf.HFError, match=match):
    hf.config_from_hf({**saved_config, **edit})


def test_use_sliding_window_that_windows_no_layer_is_read_as_full_attention(saved_config):
  # Qwen2.5's released configs: a window from max_window_layers on, which is past the last layer.
  config = {**saved_config, "use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2}
  config.pop("layer_types")
  assert hf.config_from_hf(config).sliding_window_size == 0


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(use_qk_norm=True), r"decoder_block='qwen2' has no query/key norms"),
        (dict(sliding_window_size=8), r"sliding_window_size=8 with decoder_block='qwen2'"),
    ],
)
def test_bad_qwen2_settings_are_refused_with_the_reason(overrides, match):
  with pytest.raises(ConfigError, match=match):
    mb.load_config("qwen2.5-tiny", **overrides)


def test_maxtexts_qwen2_yaml_loads_with_its_attention_bias_which_other_families_refuse(tmp_path):
  maxtext = {"decoder_block": "qwen2", "attention_bias": True, "mlp_activations": ["silu", "linear"]}
  (tmp_path / "qwen2.yml").write_text(json.dumps(maxtext))
  with pytest.warns(UserWarning, match=r"ignoring MaxText config keys .*attention_bias"):
    assert mb.load_config(str(tmp_path / "qwen2.yml")).decoder_block == "qwen2"
  (tmp_path / "llama.yml").write_text(json.dumps({**maxtext, "decoder_block": "llama2"}))
  with pytest.raises(ConfigError, match=r"'attention_bias' = True is not supported; .*attention_bias=False"):
    mb.load_config(str(tmp_path / "llama.yml"))


def test_qk_clip_scales_each_clipped_heads_query_kernel_and_bias_so_its_logits_shrink_by_s():
  config = mb.load_config("qwen2.5-tiny", scan_layers=False)
  params = mb.create_model(config, seed=0).params()
  max_logits = jnp.full((config.num_decoder_layers, config.num_query_heads), 1.0).at[0, 1].set(4 * 100.0)
  clipped = canonical.flatten(qk_clip.clip(params, {"layers": max_logits}, config.replace(qk_clip_threshold=100.0)))
  before = canonical.flatten(params)
  for path, head_axis in (("query/kernel", 1), ("query/bias", 0)):
    leaf, got = (
        np.asarray(before[f"decoder/layers_0/self_attention/{path}"]),
        clipped[f"decoder/layers_0/self_attention/{path}"],
    )
    want = leaf.copy()
    np.moveaxis(want, head_axis, 0)[1] *= 0.25
    np.testing.assert_array_equal(np.asarray(got), want, err_msg=path)
    np.testing.assert_array_equal(
        np.asarray(clipped[f"decoder/layers_1/self_attention/{path}"]), before[f"decoder/layers_1/self_attention/{path}"]
    )
