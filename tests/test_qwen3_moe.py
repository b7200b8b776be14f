"""Qwen3-MoE (decoder_block qwen3_moe) on both backends: against transformers, and with every feature.

A tiny random Qwen3MoeForCausalLM is saved by transformers and imported: our
logits match its logits, 24 greedy tokens match its `generate`, export-hf
round-trips. norm_topk_prob=false (the class default) keeps each chosen
expert's share of the whole softmax, and must read so. Vocabulary tiling,
LoRA and AQT run on the family; QK-Clip is refused, as its query/key norms
undo it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge.core import canonical  # noqa: E402
from maxbridge.core.config import ConfigError  # noqa: E402
from maxbridge.interop import hf  # noqa: E402
from maxbridge.ops import moe as moe_ops  # noqa: E402
from test_hf import LOGITS_TOL, max_diff  # noqa: E402
from conftest import LINEN  # noqa: E402
from hf_family import NNX, TOKENS, Saved, assert_matches_transformers, assert_same_tree  # noqa: E402
from hf_family import assert_tiled_nnx_matches_untiled_linen, export_and_reimport, family_config  # noqa: E402
from hf_family import TINY, int8_logits, train_steps  # noqa: E402

PRESET = "qwen3-moe-tiny"
DIMS = dict(
    **TINY,
    num_hidden_layers=2,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=True,
    rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
)


def saved(folder, **changes) -> Saved:
  """A tiny random Qwen3Moe saved by transformers, with its logits and greedy continuation."""
  torch.manual_seed(0)
  config = transformers.Qwen3MoeConfig(**{**DIMS, **changes})
  return Saved(transformers.Qwen3MoeForCausalLM(config), folder)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return saved(tmp_path_factory.mktemp("qwen3_moe") / "hf")


@pytest.fixture(scope="module")
def unnormalised(tmp_path_factory):
  return saved(tmp_path_factory.mktemp("qwen3_moe_unnormalised") / "hf", norm_topk_prob=False)


# --- Hugging Face -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend, scan_layers", [("linen", True), ("nnx", False)], ids=["linen-scanned", "nnx-unscanned"]
)
def test_imported_logits_and_24_greedy_tokens_match_transformers(reference, backend, scan_layers):
  model = mb.from_pretrained(reference.folder, backend=backend, scan_layers=scan_layers)
  assert (model.config.decoder_block, model.config.moe_mlp_dim, model.config.num_experts) == ("qwen3_moe", 32, 8)
  assert_matches_transformers(model, reference)


@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_norm_topk_prob_false_keeps_each_experts_softmax_share(unnormalised, backend):
  model = mb.from_pretrained(unnormalised.folder, backend=backend)
  assert (model.config.routed_score_func, model.config.norm_topk_prob) == ("softmax", False)
  assert max_diff(model.logits(TOKENS), unnormalised.logits) <= LOGITS_TOL
  # Renormalising the same weights moves the logits well past the tolerance: the key is what matches.
  renormalised = mb.from_pretrained(unnormalised.folder, backend=backend, norm_topk_prob=True)
  assert max_diff(renormalised.logits(TOKENS), unnormalised.logits) > 100 * LOGITS_TOL


def test_export_loads_in_transformers_and_reimports_exactly(reference, tmp_path):
  exported, first, again = export_and_reimport(reference, tmp_path, transformers.Qwen3MoeForCausalLM)
  assert exported.config.norm_topk_prob is True
  assert_same_tree(first, again)


def test_mixtral_routing_exports_as_the_renormalised_softmax(tmp_path):
  # routed_score_func='' (MaxText's presets) is the softmax's top k renormalised: norm_topk_prob=true.
  model = mb.create_model(mb.load_config(PRESET, routed_score_func="", norm_topk_prob=False), seed=0)
  hf.save_hf(model.params(), model.config, tmp_path / "hf")
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
  assert hf_model.config.norm_topk_prob is True
  with torch.no_grad():
    want = hf_model(torch.tensor(TOKENS)).logits.numpy()
  assert max_diff(model.logits(TOKENS), want) <= LOGITS_TOL


def test_top_k_of_softmax_is_the_softmax_share_and_renormalised_is_mixtrals():
  logits = jax.random.normal(jax.random.key(0), (5, 8))
  weights, indices = moe_ops.top_k_of_softmax(logits, 3, normalize=False)
  probs = jax.nn.softmax(logits, axis=-1)
  np.testing.assert_allclose(weights, jnp.take_along_axis(probs, indices, axis=-1), rtol=1e-6)
  assert float(jnp.max(jnp.sum(weights, axis=-1))) < 1
  normalised, same = moe_ops.top_k_of_softmax(logits, 3, normalize=True)
  mixtral, mixtral_indices = moe_ops.top_k_softmax(logits, 3)
  np.testing.assert_array_equal(same, mixtral_indices)
  np.testing.assert_allclose(normalised, mixtral, rtol=1e-6)


# --- config ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(use_qk_clip=True), r"use_qk_clip=true with use_qk_norm=true: the query/key RMSNorm undoes"),
        (dict(use_qk_norm=False), r"decoder_block='qwen3_moe' normalises each query and key head: set use_qk_norm"),
        (dict(routed_score_func="sigmoid"), r"routed_score_func='sigmoid' and routed_bias=False must be 'softmax'"),
        (dict(num_experts=1, num_experts_per_tok=1), r"routes tokens to experts: num_experts must be >= 2"),
    ],
)
def test_settings_the_family_cannot_take_are_refused_naming_the_key(overrides, match):
  with pytest.raises(ConfigError, match=match):
    mb.load_config(PRESET, **overrides)


@pytest.mark.parametrize("preset", ["qwen3-30b-a3b", "qwen3-235b-a22b"])
def test_real_size_presets_have_transformers_parameter_count(preset):
  """Built abstractly (shapes only); transformers' model of the same config is built on the meta device."""
  config = mb.load_config(preset)
  shapes = canonical.flatten(hf.abstract_params(config))
  assert shapes["decoder/layers/moe_block/wi_0"].shape == (
      128,
      config.num_decoder_layers,
      config.emb_dim,
      config.moe_mlp_dim,
  )
  hf_config = transformers.Qwen3MoeConfig(**hf.config_to_hf(config))
  with torch.device("meta"):
    want = sum(p.numel() for p in transformers.Qwen3MoeForCausalLM(hf_config).parameters())
  assert sum(int(np.prod(s.shape)) for s in shapes.values()) == want


# MaxText's configs/models/qwen3-30b-a3b.yml, its keys and values as MaxText writes them.
MAXTEXT_30B = """
decoder_block: "qwen3_moe"
base_emb_dim: 2048
base_mlp_dim: 768
base_num_query_heads: 32
base_num_kv_heads: 4
base_num_decoder_layers: 48
head_dim: 128
mlp_activations: ["silu", "linear"]
vocab_size: 151936
normalization_layer_epsilon: 1.0e-6
use_qk_norm: True
num_experts: 128
num_experts_per_tok: 8
base_moe_mlp_dim: 768
norm_topk_prob: true
rope_max_timescale: 10_000_000
enable_dropout: False
"""


def test_maxtexts_own_yaml_reads_as_our_preset(tmp_path):
  path = tmp_path / "qwen3-30b-a3b.yml"
  path.write_text(MAXTEXT_30B)
  with pytest.warns(UserWarning, match="mlp_activations, enable_dropout"):
    theirs = mb.load_config(str(path))
  ours = mb.load_config("qwen3-30b-a3b")
  model_keys = [key for key in yaml.safe_load(MAXTEXT_30B) if key not in ("mlp_activations", "enable_dropout")]
  model_keys = ["moe_mlp_dim" if key == "base_moe_mlp_dim" else key for key in model_keys]
  assert {key: getattr(theirs, key) for key in model_keys} == {key: getattr(ours, key) for key in model_keys}
  assert (theirs.routed_score_func, theirs.load_balance_loss_weight) == (
      ours.routed_score_func,
      ours.load_balance_loss_weight,
  )


# --- features -------------------------------------------------------------------------------------


# The MoE families' one tiling row (gpt-oss's and OLMo's heads are llama's, tiled in test_vocab_tiling.py): the
# load-balancing loss joins a tiled cross-entropy.
def test_vocab_tiling_on_nnx_gives_untiled_linens_loss_and_gradients():
  assert_tiled_nnx_matches_untiled_linen(PRESET)


@pytest.mark.parametrize("flags", [LINEN, NNX], ids=["linen", "nnx"])
def test_lora_trains_its_adapters_and_leaves_the_experts_alone(flags):
  config = family_config(PRESET, flags, lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, per_device_batch_size=2)
  losses, before, after, adapters = train_steps(config)
  assert losses[-1] < losses[0]
  adapted = [path for path in canonical.flatten(adapters) if path.endswith("_lora_a")]
  assert adapted and all("self_attention" in path for path in adapted), adapted
  for path, leaf in canonical.flatten(before).items():
    np.testing.assert_array_equal(canonical.flatten(after)[path], leaf, err_msg=path)


def test_aqt_int8_runs_alike_on_both_backends_and_stays_near_float():
  float_logits, linen, nnx = int8_logits(PRESET)
  np.testing.assert_allclose(nnx, linen, rtol=1e-5, atol=1e-5)
  assert 0 < max_diff(linen, float_logits) < 0.1 * float(np.max(np.abs(float_logits)))
