"""OLMo 3 (decoder_block olmo3): blocks of three windowed layers and a global one, against transformers.

The reference is a tiny random `Olmo3ForCausalLM` of two blocks (8 layers),
its window (4) shorter than the test sequences, so a layer given the wrong
kind, or a window dropped, changes the logits. OLMo 2's layers, features and
QK-norm are tested in test_olmo2.py.
"""

import json

import jax.numpy as jnp
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge.core.config import ConfigError  # noqa: E402
from maxbridge.interop import hf  # noqa: E402
from hf_family import TOKENS, Saved, assert_matches_transformers, assert_same_tree, export_and_reimport  # noqa: E402
from hf_family import highest_precision  # noqa: E402,F401 (an autouse fixture)
from test_hf import LOGITS_TOL, max_diff  # noqa: E402
from test_olmo2 import DIMS  # noqa: E402

WINDOW = 4
BLOCKS = 2


def saved(folder, window: int = WINDOW, generate: bool = True) -> Saved:
  """A saved tiny OLMo 3 and what transformers computes with it."""
  torch.manual_seed(0)
  config = transformers.Olmo3Config(
      **{**DIMS, "num_hidden_layers": 4 * BLOCKS, "rope_parameters": None}, sliding_window=window
  )
  return Saved(transformers.Olmo3ForCausalLM(config), folder, generate=generate)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return saved(tmp_path_factory.mktemp("olmo3") / "hf")


@pytest.mark.parametrize("backend, scan_layers", [("linen", True), ("nnx", False), ("nnx", True)])
def test_imported_logits_and_a_24_token_greedy_continuation_match_transformers(reference, backend, scan_layers):
  model = mb.from_pretrained(reference.folder, backend=backend, scan_layers=scan_layers)
  cfg = model.config
  assert (cfg.decoder_block, cfg.num_decoder_layers, cfg.sliding_window_size) == ("olmo3", 4 * BLOCKS, WINDOW)
  assert cfg.rope_max_timescale == 500000  # Olmo3Config's own default theta
  if scan_layers:  # the blocks are stacked: one scan over BLOCKS, no loop over layers
    assert model.params()["decoder"]["layers"]["global"]["mlp"]["wo"]["kernel"].shape[cfg.param_scan_axis] == BLOCKS
  assert_matches_transformers(model, reference)


def test_the_window_changes_the_result_as_transformers_computes_it(reference, tmp_path):
  """The same weights with a window covering the sequence: other logits, which we read as transformers does."""
  wide = saved(tmp_path / "hf", window=64, generate=False)
  assert max_diff(wide.logits, reference.logits) > 0.1
  model = mb.from_pretrained(wide.folder, backend="linen")
  assert max_diff(model.logits(jnp.asarray(TOKENS, jnp.int32)), wide.logits) <= LOGITS_TOL


def test_export_loads_in_transformers_and_reimports_the_same_tree(reference, tmp_path):
  exported, first, again = export_and_reimport(reference, tmp_path, transformers.Olmo3ForCausalLM)
  assert exported.config.layer_types == reference.model.config.layer_types
  assert "decoder/layers_1/global/self_attention/query_norm/scale" in first  # Hugging Face's layer 7
  assert_same_tree(first, again)


@pytest.fixture(scope="module")
def saved_config(reference):
  return json.loads((reference.folder / "config.json").read_text())


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            {"layer_types": ["full_attention"] + ["sliding_attention"] * 7},
            r"num_hidden_layers=8 with layer_types=.* is not supported; maxbridge's olmo3 stacks blocks",
        ),
        ({"num_hidden_layers": 6, "layer_types": None}, r"num_hidden_layers=6 with layer_types="),
        ({"sliding_window": None}, r"sliding_window=None must be a positive integer"),
        (
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                }
            },
            r"gives the two layer kinds different RoPE \{'sliding_attention': 10000, 'full_attention': 1000000\}",
        ),
        (
            {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}},
            r"rope_scaling gives full_attention layers rope_type='yarn'; maxbridge's olmo3 implements default",
        ),
        ({"attention_bias": True}, r"attention_bias=True is not supported"),
    ],
)
def test_configs_olmo3_cannot_compute_are_refused_naming_the_field(saved_config, edit, match):
  with pytest.raises(hf.HFError, match=match):
    hf.config_from_hf({**saved_config, **edit})


def test_rope_is_read_per_layer_kind_as_olmo3config_builds_it(saved_config):
  # Absent, or flat (whose keys Olmo3Config does not read): both kinds get the class's theta.
  for rope in (None, {"rope_type": "default", "rope_theta": 3e4}):
    config = {**saved_config, "layer_types": None, "rope_parameters": rope}
    assert hf.config_from_hf(config).rope_max_timescale == 500000
  kinds = ("full_attention", "sliding_attention")
  config = {**saved_config, "rope_parameters": {kind: {"rope_type": "default", "rope_theta": 2e4} for kind in kinds}}
  assert hf.config_from_hf(config).rope_max_timescale == 20000
  # A top-level rope_theta reaches the full_attention layers only.
  with pytest.raises(hf.HFError, match=r"different RoPE \{'sliding_attention': 500000, 'full_attention': 20000\}"):
    hf.config_from_hf({**saved_config, "rope_parameters": None, "rope_theta": 2e4})
  assert transformers.Olmo3Config(rope_theta=2e4).rope_parameters["sliding_attention"]["rope_theta"] == 500000


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(use_qk_clip=True), r"use_qk_clip=true with use_qk_norm=true"),
        (dict(sliding_window_size=0), r"decoder_block='olmo3' gives three of every four layers .* sliding_window_size"),
        (dict(base_num_decoder_layers=6), r"base_num_decoder_layers=6 must be a multiple of 4"),
    ],
)
def test_bad_olmo3_settings_are_refused_with_the_reason(overrides, match):
  with pytest.raises(ConfigError, match=match):
    mb.load_config("olmo3-tiny", **overrides)
