"""Qwen3.5 (decoder_block qwen3_5), dense and MoE, against transformers' Qwen3_5ForCausalLM and
Qwen3_5MoeForCausalLM.

Qwen3.5 runs Qwen3-Next's layers (tests/test_qwen3_next.py covers the gated
DeltaNet's math, the zero-centred norms, LoRA, AQT and vocabulary tiling on
them); what is its own is the dense MLP (num_experts=1), the DeltaNet's input
projections stored apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), which
the canonical tree keeps fused per key head as Qwen3-Next's, and the nested
config of a *ForConditionalGeneration folder. The references are tiny random
models (no download), 4 layers (one block), grouped DeltaNet value heads.
Linen/NNX parity in every flag mix is tests/test_families.py's (qwen3.5-tiny
and qwen3.5-moe-tiny are among its FAMILIES).
"""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge import cli  # noqa: E402
from maxbridge.core import canonical  # noqa: E402
from maxbridge.core.config import ConfigError  # noqa: E402
from maxbridge.interop import hf  # noqa: E402
from hf_family import TINY, TOKENS, Saved, assert_matches_transformers, assert_same_tree, export_and_reimport  # noqa: E402
from hf_family import highest_precision  # noqa: E402,F401 (an autouse fixture)
from test_hf import LOGITS_TOL, max_diff  # noqa: E402

COMMON = dict(
    **TINY,
    num_key_value_heads=2,
    head_dim=16,
    num_hidden_layers=4,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    rms_norm_eps=1e-6,
    # Qwen3.5's checkpoints' multimodal RoPE: text positions are the same in its three streams.
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 1e6,
        "partial_rotary_factor": 0.25,
        "mrope_section": [1, 1, 0],
        "mrope_interleaved": True,
    },
)
VARIANTS = {
    "dense": (transformers.Qwen3_5TextConfig, transformers.Qwen3_5ForCausalLM, dict(intermediate_size=96)),
    "moe": (
        transformers.Qwen3_5MoeTextConfig,
        transformers.Qwen3_5MoeForCausalLM,
        dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def reference(request, tmp_path_factory):
  config_class, model_class, own = VARIANTS[request.param]
  torch.manual_seed(0)
  saved = Saved(model_class(config_class(**COMMON, **own)), tmp_path_factory.mktemp(request.param) / "hf")
  saved.variant, saved.model_class = request.param, model_class
  return saved


# The dense model on scanned Linen and the MoE on NNX run the whole check (logits, then 24 greedy tokens by `generate`
# and by mb.Engine); each on the other backend, its logits.
FULL_CHECK = {"dense": ("linen", True), "moe": ("nnx", False)}
OTHER = {"dense": ("nnx", False), "moe": ("linen", True)}


def test_logits_and_a_24_token_greedy_continuation_match_transformers(reference):
  backend, scan_layers = FULL_CHECK[reference.variant]
  model = mb.from_pretrained(reference.folder, backend=backend, scan_layers=scan_layers)
  cfg = model.config
  assert (cfg.decoder_block, cfg.partial_rotary_factor, cfg.rope_max_timescale) == ("qwen3_5", 0.25, 1_000_000)
  assert (cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim) == (2, 4, 8, 12)
  if reference.variant == "dense":
    assert (cfg.num_experts, cfg.mlp_dim) == (1, 96)
  else:
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.shared_experts, cfg.norm_topk_prob) == (4, 2, 2, True)
  assert_matches_transformers(model, reference)


def test_the_other_backend_gives_transformers_logits(reference):
  backend, scan_layers = OTHER[reference.variant]
  model = mb.from_pretrained(reference.folder, backend=backend, scan_layers=scan_layers)
  assert max_diff(model.logits(TOKENS), reference.logits) <= LOGITS_TOL


def test_the_deltanet_inputs_are_regrouped_per_key_head(reference):
  """in_proj_qkv's rows [q heads, k heads, v heads] and in_proj_z's land in Qwen3-Next's in_proj_qkvz: per key head
  its query, key, its two value heads' values, then their gates; in_proj_b then in_proj_a in in_proj_ba."""
  model = mb.from_pretrained(reference.folder, backend="linen", scan_layers=False)
  flat = canonical.flatten(model.params())
  mixer = "decoder/layers_0/linear_0/linear_attention"
  qkvz, ba = np.asarray(flat[f"{mixer}/in_proj_qkvz/kernel"]), np.asarray(flat[f"{mixer}/in_proj_ba/kernel"])
  state = {name: tensor.detach().numpy() for name, tensor in reference.model.state_dict().items()}
  theirs = "model.layers.0.linear_attn"
  qkv, z = state[f"{theirs}.in_proj_qkv.weight"].T, state[f"{theirs}.in_proj_z.weight"].T  # [D, out]
  b, a = state[f"{theirs}.in_proj_b.weight"].T, state[f"{theirs}.in_proj_a.weight"].T
  assert qkvz.shape == (64, 2, 8 + 8 + 24 + 24) and ba.shape == (64, 2, 4)
  head = 1  # the second key head: query rows 8:16, key rows 16+8:16+16, value rows 32+24:32+48
  np.testing.assert_array_equal(qkvz[:, head, :8], qkv[:, 8:16])
  np.testing.assert_array_equal(qkvz[:, head, 8:16], qkv[:, 24:32])
  np.testing.assert_array_equal(qkvz[:, head, 16:40], qkv[:, 56:80])
  np.testing.assert_array_equal(qkvz[:, head, 40:], z[:, 24:48])
  np.testing.assert_array_equal(ba[:, head], np.concatenate([b[:, 2:4], a[:, 2:4]], axis=-1))


def test_export_loads_in_transformers_and_reimports_the_same_tree(reference, tmp_path):
  """The export is the text model: its multimodal RoPE keys, which text positions do not use, are not written."""
  exported, first, again = export_and_reimport(reference, tmp_path, reference.model_class)
  want = {**reference.model.config.to_diff_dict(), "dtype": "float32"}
  want["rope_parameters"] = {k: v for k, v in want["rope_parameters"].items() if not k.startswith("mrope_")}
  assert exported.config.to_diff_dict() == want
  assert_same_tree(first, again)


def test_a_conditional_generation_folder_reads_as_its_language_model(reference, tmp_path, caplog):
  """A Qwen3_5(Moe)ForConditionalGeneration checkpoint's layout: the text model under model.language_model., a
  vision tower under model.visual. and an MTP layer under mtp., the text config nested. import-hf reads its
  language model, leaving the vision tower and MTP layer out as transformers' ForCausalLM does; export-hf writes the
  text model, which transformers loads with the reference's logits."""
  from safetensors.torch import load_file, save_file

  folder = tmp_path / "vl"
  folder.mkdir()
  text = json.loads((reference.folder / "config.json").read_text())
  outer = "qwen3_5" if reference.variant == "dense" else "qwen3_5_moe"
  config = {"model_type": outer, "text_config": text, "vision_config": {"depth": 1}, "image_token_id": 5}
  (folder / "config.json").write_text(json.dumps(config))
  tensors = {
      name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name: tensor
      for name, tensor in load_file(reference.folder / "model.safetensors").items()
  }
  tensors["model.visual.patch_embed.proj.weight"] = torch.zeros(8, 3, 2, 2)
  tensors["mtp.fc.weight"] = torch.zeros(64, 128)
  save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
  with caplog.at_level("INFO"):
    assert cli.main(["import-hf", str(folder), str(tmp_path / "ckpt")]) == 0
  assert "2 tensors Qwen3_5" in caplog.text and "are left out (first: model.visual.patch_embed" in caplog.text
  assert cli.main(["export-hf", str(tmp_path / "ckpt"), str(tmp_path / "text")]) == 0
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text").eval()
  assert type(exported) is reference.model_class
  with torch.no_grad():
    assert max_diff(exported(torch.tensor(TOKENS)).logits.numpy(), reference.logits) <= 1e-5
  with pytest.raises(hf.HFError, match="text_config.model_type='qwen3_next'; expected"):
    hf.config_from_hf({**config, "text_config": {**text, "model_type": "qwen3_next"}})


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
        ({"attention_bias": True}, r"attention_bias=True is not supported"),
        ({"layer_types": ["full_attention"] * 4}, r"layer_types=\['full_attention'"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, r"rope_type='yarn' is not supported"),
    ],
)
def test_configs_qwen3_5_cannot_compute_are_refused_naming_the_field(edit, match):
  text = {"model_type": "qwen3_5_text", **COMMON, "intermediate_size": 96}
  with pytest.raises((hf.HFError, ConfigError), match=match):
    hf.config_from_hf({**text, **edit})


def test_config_rules_name_what_qwen3_5_needs():
  with pytest.raises(ConfigError, match="base_num_decoder_layers=6 must be a multiple of 4"):
    mb.load_config("qwen3.5-tiny", base_num_decoder_layers=6)
  with pytest.raises(ConfigError, match=r"mtp_num_layers=1 with decoder_block='qwen3_5'"):
    mb.load_config("qwen3.5-moe-tiny", mtp_num_layers=1)
  with pytest.raises(ConfigError, match=r"decoder_block='qwen3_5' has a gated shared expert"):
    mb.load_config("qwen3.5-moe-tiny", shared_experts=0)
  with pytest.raises(ConfigError, match=r"use_qk_clip=true with decoder_block='qwen3_5'"):
    mb.load_config("qwen3.5-tiny", use_qk_clip=True, use_qk_norm=False)
  with pytest.raises(ConfigError, match=r"gdn_num_key_heads=4 is read by decoder_block='qwen3_next' and 'qwen3_5'"):
    mb.load_config("qwen3-moe-tiny", gdn_num_key_heads=4)


def test_a_moe_export_needs_renormalised_routing():
  config = mb.load_config("qwen3.5-moe-tiny", norm_topk_prob=False)
  with pytest.raises(hf.HFError, match="norm_topk_prob=true"):
    hf.config_to_hf(config)
  assert hf.config_to_hf(mb.load_config("qwen3.5-tiny"))["architectures"] == ["Qwen3_5ForCausalLM"]
  assert hf.config_to_hf(mb.load_config("qwen3.5-moe-tiny"))["architectures"] == ["Qwen3_5MoeForCausalLM"]
