"""GLM-4.5 (decoder_block glm4_moe): attention with q/k/v biases, QK-norm and half-rotated heads, then one dense
layer and DeepSeek-V3-routed MoE layers, against transformers' Glm4MoeForCausalLM.

The reference is a tiny random model (no download), every parameter random,
the router's correction bias included, with 2 of 4 expert groups open to each
token, so that a bias dropped, a RoPE turning the wrong dims, or routing
without the group limit changes the logits. Linen/NNX parity in every flag mix
is tests/test_families.py's (glm4.5-tiny is one of its FAMILIES); every config
field (QK-norm off among them) is test_hf_fields.py's.
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge.core import canonical  # noqa: E402
from maxbridge.core.config import ConfigError  # noqa: E402
from maxbridge.interop import hf  # noqa: E402
from hf_family import TINY, TOKENS, Saved, assert_matches_transformers, assert_same_tree, export_and_reimport  # noqa: E402
from hf_family import highest_precision  # noqa: E402,F401 (an autouse fixture)
from test_hf import max_diff  # noqa: E402

DIMS = dict(
    **TINY,
    num_hidden_layers=3,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    attention_bias=True,
    use_qk_norm=True,
    rms_norm_eps=1e-5,
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  """A saved tiny GLM-4.5 (QK-norm on, as the 355B) and what transformers computes with it."""
  torch.manual_seed(0)
  rope = {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.5}
  config = transformers.Glm4MoeConfig(**DIMS, rope_parameters=rope)
  return Saved(transformers.Glm4MoeForCausalLM(config), tmp_path_factory.mktemp("glm4_moe") / "hf")


@pytest.mark.parametrize("backend, scan_layers", [("linen", True), ("nnx", False)])
def test_imported_logits_and_a_24_token_greedy_continuation_match_transformers(reference, backend, scan_layers):
  model = mb.from_pretrained(reference.folder, backend=backend, scan_layers=scan_layers)
  cfg = model.config
  assert (cfg.decoder_block, cfg.partial_rotary_factor, cfg.use_qk_norm) == ("glm4_moe", 0.5, True)
  assert (cfg.n_routing_groups, cfg.topk_routing_group, cfg.first_num_dense_layers, cfg.mtp_num_layers) == (4, 2, 1, 0)
  flat = canonical.flatten(model.params())
  moe = "decoder/moe_layers" if scan_layers else "decoder/moe_layers_0"
  assert np.std(np.asarray(flat[f"{moe}/DeepSeekMoeBlock_0/MoeBlock_0/gate/bias"])) > 0.05  # random, read
  assert np.std(np.asarray(flat[f"{moe}/self_attention/key/bias"])) > 0.1
  assert_matches_transformers(model, reference)


def test_the_group_limit_and_the_correction_bias_change_which_experts_win(reference):
  """Without the group limit, or with the correction bias zeroed, the same weights give other logits."""
  ungrouped = mb.from_pretrained(reference.folder, backend="linen", n_routing_groups=-1, topk_routing_group=-1)
  assert max_diff(ungrouped.logits(TOKENS), reference.logits) > 1e-2
  model = mb.from_pretrained(reference.folder, backend="linen", scan_layers=False)
  flat = canonical.flatten(model.params())
  zeroed = canonical.unflatten({path: value * 0 if path.endswith("gate/bias") else value for path, value in flat.items()})
  unbiased = mb.create_model(model.config, params=zeroed)
  assert max_diff(unbiased.logits(TOKENS), reference.logits) > 1e-2


def test_export_loads_in_transformers_and_reimports_the_same_tree(reference, tmp_path):
  exported, first, again = export_and_reimport(reference, tmp_path, transformers.Glm4MoeForCausalLM)
  assert exported.config.rope_parameters["partial_rotary_factor"] == 0.5
  assert (exported.config.n_group, exported.config.topk_group, exported.config.use_qk_norm) == (4, 2, True)
  assert "decoder/moe_layers_1/DeepSeekMoeBlock_0/MoeBlock_0/gate/bias" in first
  assert_same_tree(first, again)


def test_a_stored_mtp_layer_is_refused_by_name_and_mtp_num_layers_0_leaves_it_out(reference, tmp_path):
  """GLM-4.5's checkpoints store an MTP layer after the decoder's, which maxbridge does not run."""
  from safetensors.torch import load_file, save_file

  folder = tmp_path / "with_mtp"
  folder.mkdir()
  for name in ("config.json", "generation_config.json"):
    if (reference.folder / name).exists():
      (folder / name).write_bytes((reference.folder / name).read_bytes())
  tensors = load_file(reference.folder / "model.safetensors")
  mtp = "model.layers.3"
  for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
    tensors[f"{mtp}.{name}"] = torch.ones(64)
  tensors[f"{mtp}.eh_proj.weight"] = torch.zeros(64, 128)
  tensors[f"{mtp}.input_layernorm.weight"] = torch.ones(64)
  save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
  with pytest.raises(ConfigError, match=r"mtp_num_layers=1: decoder_block='glm4_moe' runs no multi-token prediction"):
    mb.from_pretrained(folder, backend="linen")
  model = mb.from_pretrained(folder, backend="linen", mtp_num_layers=0)
  assert max_diff(model.logits(TOKENS), reference.logits) <= 1e-4


@pytest.fixture(scope="module")
def saved_config(reference):
  return json.loads((reference.folder / "config.json").read_text())


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"attention_bias": False}, r"attention_bias=False is not supported"),
        ({"norm_topk_prob": False}, r"norm_topk_prob=False is not supported"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, r"rope_type='yarn' is not supported"),
        ({"topk_group": 5}, r"topk_routing_group=5 exceeds n_routing_groups=4"),
    ],
)
def test_configs_glm4_moe_cannot_compute_are_refused_naming_the_field(saved_config, edit, match):
  with pytest.raises((hf.HFError, ConfigError), match=match):
    hf.config_from_hf({**saved_config, **edit})


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(partial_rotary_factor=0.1), r"partial_rotary_factor=0.1 x head_dim=16 = 1 dims"),
        (dict(norm_topk_prob=False), r"norm_topk_prob=False must be 'sigmoid', true and true"),
        (dict(routed_bias=False), r"routed_bias=False and norm_topk_prob=True must be"),
        (dict(sliding_window_size=8), r"sliding_window_size=8: decoder_block='glm4_moe' attends in full"),
        (dict(mtp_num_layers=1), r"mtp_num_layers=1: decoder_block='glm4_moe' runs no multi-token prediction"),
    ],
)
def test_bad_glm4_moe_settings_are_refused_with_the_reason(overrides, match):
  with pytest.raises(ConfigError, match=match):
    mb.load_config("glm4.5-tiny", **overrides)


def test_partial_rotary_factor_stays_refused_in_families_that_turn_whole_heads():
  with pytest.raises(
      ConfigError,
      match=r"partial_rotary_factor=0.5 is read by decoder_block='qwen3_next' and 'glm4_moe' and 'qwen3_5' only",
  ):
    mb.load_config("qwen2.5-tiny", partial_rotary_factor=0.5)
