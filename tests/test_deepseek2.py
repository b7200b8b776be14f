"""DeepSeek-V2 (decoder_block deepseek, softmax routing) against transformers' DeepseekV2ForCausalLM.

Two tiny random models (no download), every parameter random: V2 236B's shape (a query LoRA, YaRN with
mscale = mscale_all_dim, `group_limited_greedy` routing keeping 2 of 4 groups, scaled by 2) and V2-Lite's (no
query LoRA, plain RoPE, `greedy` routing). Linen/NNX parity in every flag mix is tests/test_families.py's
(deepseek2-tiny is one of its FAMILIES); every config field is test_hf_fields.py's.
"""

import json

import jax.numpy as jnp
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge.core.config import ConfigError  # noqa: E402
from maxbridge.interop import hf  # noqa: E402
from hf_family import TINY, TOKENS, Saved, assert_matches_transformers, assert_same_tree  # noqa: E402
from hf_family import export_and_reimport, max_diff  # noqa: E402
from hf_family import highest_precision  # noqa: E402,F401 (an autouse fixture)
from test_hf import LOGITS_TOL  # noqa: E402

DIMS = dict(
    **TINY,
    num_hidden_layers=3,
    num_key_value_heads=4,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    first_k_dense_replace=1,
    n_shared_experts=2,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    rms_norm_eps=1e-6,
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "mscale": 0.707,
    "mscale_all_dim": 0.707,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
}
VARIANTS = {
    # V2 236B's: a query LoRA, YaRN, the top 2 of 4 groups by their best expert, weights times 2. Three experts a
    # token (as V2's 6 from 3 groups): ranking groups by their best expert, two never limit the top two.
    "grouped": dict(
        num_experts_per_tok=3,
        q_lora_rank=32,
        topk_method="group_limited_greedy",
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.0,
        rope_parameters=YARN,
    ),
    # V2-Lite's: no query LoRA, plain RoPE, the top k of every expert.
    "greedy": dict(
        num_experts_per_tok=2,
        q_lora_rank=None,
        topk_method="greedy",
        rope_parameters={"rope_type": "default", "rope_theta": 1e4},
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def reference(request, tmp_path_factory):
  torch.manual_seed(0)
  config = transformers.DeepseekV2Config(**DIMS, **VARIANTS[request.param])
  saved = Saved(transformers.DeepseekV2ForCausalLM(config), tmp_path_factory.mktemp(request.param) / "hf")
  saved.variant = request.param
  return saved


@pytest.mark.parametrize("backend, scan_layers", [("linen", True), ("nnx", False)])
def test_imported_logits_and_a_24_token_greedy_continuation_match_transformers(reference, backend, scan_layers):
  model = mb.from_pretrained(reference.folder, backend=backend, scan_layers=scan_layers)
  cfg = model.config
  assert (cfg.decoder_block, cfg.routed_score_func, cfg.routed_bias, cfg.norm_topk_prob) == (
      "deepseek",
      "softmax",
      False,
      False,
  )
  if reference.variant == "grouped":
    assert (cfg.q_lora_rank, cfg.n_routing_groups, cfg.topk_routing_group, cfg.rope_type) == (32, 4, 2, "yarn")
    assert (cfg.mscale, cfg.rope_attention_scaling, cfg.routed_scaling_factor) == (0.707, False, 2.0)
  else:
    assert (cfg.q_lora_rank, cfg.n_routing_groups, cfg.rope_type) == (0, -1, "default")
  assert_matches_transformers(model, reference)


@pytest.mark.parametrize("reference", ["grouped"], indirect=True)  # greedy routing has no groups to limit
def test_the_group_limit_changes_which_experts_win(reference):
  """Without the group limit, or with the chosen weights renormalised (as V3's are), the logits are another
  model's: the tiny model's routing is one where both matter."""
  model = mb.from_pretrained(reference.folder, backend="linen")
  tokens = jnp.asarray(TOKENS, jnp.int32)
  assert max_diff(model.logits(tokens), reference.logits) <= LOGITS_TOL
  ungrouped = mb.create_model(model.config.replace(n_routing_groups=-1, topk_routing_group=-1), params=model.params())
  assert max_diff(ungrouped.logits(tokens), reference.logits) > 100 * LOGITS_TOL
  renormalised = mb.create_model(model.config.replace(norm_topk_prob=True), params=model.params())
  assert max_diff(renormalised.logits(tokens), reference.logits) > 100 * LOGITS_TOL


def test_export_loads_in_transformers_and_reimports_the_same_tree(reference, tmp_path):
  exported, first, again = export_and_reimport(reference, tmp_path, transformers.DeepseekV2ForCausalLM)
  want = VARIANTS[reference.variant]
  assert (exported.config.topk_method, exported.config.q_lora_rank) == (want["topk_method"], want["q_lora_rank"])
  assert exported.config.routed_scaling_factor == want.get("routed_scaling_factor", 1.0)
  assert not any("e_score_correction" in path or "/gate/bias" in path for path in first)
  assert_same_tree(first, again)


@pytest.fixture(scope="module")
def saved_config(reference):
  return json.loads((reference.folder / "config.json").read_text())


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"norm_topk_prob": True}, r"norm_topk_prob=True is not supported"),
        ({"topk_method": "noaux_tc"}, r"topk_method='noaux_tc' is not supported; .*'greedy' or 'group_limited_greedy'"),
        ({"scoring_func": "sigmoid"}, r"scoring_func='sigmoid' is not supported"),
        ({"moe_layer_freq": 2}, r"moe_layer_freq=2 is not supported"),
        ({"mlp_bias": True}, r"mlp_bias=True is not supported"),
        ({"attention_bias": True}, r"attention_bias=True is not supported"),
        ({"hidden_act": "gelu"}, r"hidden_act='gelu' is not supported"),
    ],
)
def test_configs_deepseek_v2_cannot_compute_are_refused_naming_the_field(saved_config, edit, match):
  with pytest.raises(hf.HFError, match=match):
    hf.config_from_hf({**saved_config, **edit})


def test_a_correction_bias_without_sigmoid_scores_is_refused_and_a_v3_config_does_not_export_as_v2():
  with pytest.raises(ConfigError, match=r"routed_bias=true with routed_score_func='softmax'"):
    mb.load_config("deepseek2-tiny", routed_bias=True)
  assert hf.family_for_config(mb.load_config("deepseek2-tiny")).model_type == "deepseek_v2"
  assert hf.family_for_config(mb.load_config("deepseek3-tiny")).model_type == "deepseek_v3"
