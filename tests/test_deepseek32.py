"""DeepSeek-V3.2 (MLA with a lightning indexer, `use_indexer`) against transformers' DeepseekV32ForCausalLM, and
Kimi-K2's folders (model_type kimi_k2, DeepSeek-V3's architecture) read as DeepSeek-V3.

The reference is a tiny random model (no download) whose indexer keeps 4 keys
a query while the test's sequences are 12 tokens long, so that the indexer's
choice changes the logits: the same weights with every key kept differ from
transformers'. Its 8 indexer heads make two keys' scores tie (all heads'
ReLUs zero) rarely. Linen/NNX parity in every flag mix is
tests/test_families.py's (deepseek3.2-tiny is one of its FAMILIES); every
config field is test_hf_fields.py's.
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
from maxbridge.ops import indexer  # noqa: E402
from hf_family import TINY, TOKENS, Saved, assert_matches_transformers, assert_same_tree, export_and_reimport  # noqa: E402
from hf_family import highest_precision  # noqa: E402,F401 (an autouse fixture)
from test_hf import LOGITS_TOL, max_diff, randomize  # noqa: E402

MOE = dict(
    **TINY,
    num_hidden_layers=2,
    num_key_value_heads=4,
    intermediate_size=128,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=12,
    rms_norm_eps=1e-5,
)
INDEXER = dict(index_topk=4, index_n_heads=8, index_head_dim=16)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  torch.manual_seed(0)
  config = transformers.DeepseekV32Config(**MOE, **INDEXER, rope_parameters={"rope_type": "default", "rope_theta": 1e4})
  return Saved(transformers.DeepseekV32ForCausalLM(config), tmp_path_factory.mktemp("deepseek_v32") / "hf")


def test_imported_logits_and_cached_greedy_decoding_match_transformers(reference):
  """Linen: logits, and 24 greedy tokens through `generate` and the engine (the indexer's keys cached with the
  latent, each decode step's query choosing among the whole cache's)."""
  model = mb.from_pretrained(reference.folder, backend="linen", scan_layers=True)
  cfg = model.config
  assert (cfg.use_indexer, cfg.indexer_topk, cfg.indexer_n_heads, cfg.indexer_head_dim) == (True, 4, 8, 16)
  assert TOKENS.shape[1] > cfg.indexer_topk
  flat = canonical.flatten(model.params())
  assert np.std(np.asarray(flat["decoder/moe_layers/self_attention/indexer/k_norm/bias"])) > 0.05  # random, read
  assert_matches_transformers(model, reference)


def test_nnx_logits_match_transformers(reference):
  model = mb.from_pretrained(reference.folder, backend="nnx", scan_layers=False)
  assert max_diff(model.logits(jnp.asarray(TOKENS, jnp.int32)), reference.logits) <= LOGITS_TOL


def test_the_indexers_choice_changes_transformers_logits(reference):
  """The same weights with every key kept (transformers' own model, a top-k past the sequence) give other logits,
  so matching them at top-k 4 tests the sparsity."""
  dense = transformers.DeepseekV32ForCausalLM.from_pretrained(reference.folder, index_topk=TOKENS.shape[1]).eval()
  with torch.no_grad():
    assert max_diff(dense(torch.tensor(TOKENS)).logits.numpy(), reference.logits) > 1e-2


def test_export_loads_in_transformers_and_reimports_the_same_tree(reference, tmp_path):
  exported, first, again = export_and_reimport(reference, tmp_path, transformers.DeepseekV32ForCausalLM)
  assert (exported.config.index_topk, exported.config.index_n_heads, exported.config.index_head_dim) == (4, 8, 16)
  assert "decoder/moe_layers_0/self_attention/indexer/wq_b/kernel" in first
  assert_same_tree(first, again)


def test_top_k_keys_keeps_each_querys_best_visible_keys():
  """By hand: query 3 sees keys 0-3 and keeps its 2 best; query 1 sees 2 keys and keeps both; query 0 its one."""
  scores = jnp.asarray([[[5.0, 9, 9, 9], [1, 2, 9, 9], [3, 1, 2, 9], [0.5, 4, -1, 3]]])
  visible = jnp.tril(jnp.ones((4, 4), bool))[None]
  kept = indexer.top_k_keys(scores, visible, 2)
  want = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]]
  np.testing.assert_array_equal(np.asarray(kept[0]), np.asarray(want, bool))


def test_index_scores_are_the_weighted_sum_of_relu_dot_products():
  rng = np.random.default_rng(0)
  query, key, weights = rng.normal(size=(1, 3, 2, 4)), rng.normal(size=(1, 5, 4)), rng.normal(size=(1, 3, 2))
  want = np.einsum("bth,bths->bts", weights / np.sqrt(2), np.maximum(np.einsum("bthd,bsd->bths", query, key) / 2, 0))
  got = indexer.scores(jnp.asarray(query), (jnp.asarray(key[:, :2]), jnp.asarray(key[:, 2:])), jnp.asarray(weights))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(q_lora_rank=0), r"use_indexer=true needs q_lora_rank > 0"),
        (dict(indexer_head_dim=4), r"indexer_head_dim=4 must be at least qk_rope_head_dim=8"),
        (dict(indexer_topk=0), r"indexer_topk=0 must be a positive integer"),
        (dict(attention="flash"), r"attention='flash' with use_indexer=true"),
    ],
)
def test_bad_indexer_settings_are_refused_with_the_reason(overrides, match):
  with pytest.raises(ConfigError, match=match):
    mb.load_config("deepseek3.2-tiny", **overrides)


def test_the_indexer_keys_are_refused_outside_deepseek():
  with pytest.raises(ConfigError, match=r"use_indexer=True is read by decoder_block='deepseek' only"):
    mb.load_config("llama-tiny", use_indexer=True)


def test_a_kimi_k2_folder_reads_as_deepseek_v3_with_transformers_logits(tmp_path):
  """Kimi-K2 ships DeepseekV3ForCausalLM under model_type kimi_k2 (its own sizes: one group, one dense layer)."""
  torch.manual_seed(0)
  dims = {**MOE, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 2.827}
  model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**dims)).eval()
  randomize(model)
  model.save_pretrained(tmp_path)
  with torch.no_grad():
    want = model(torch.tensor(TOKENS)).logits.numpy()
  config = json.loads((tmp_path / "config.json").read_text())
  (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "kimi_k2"}))
  ours = mb.from_pretrained(tmp_path, backend="nnx")
  assert (ours.config.decoder_block, ours.config.routed_scaling_factor, ours.config.use_indexer) == (
      "deepseek",
      2.827,
      False,
  )
  assert max_diff(ours.logits(jnp.asarray(TOKENS, jnp.int32)), want) <= 1e-5
  # It exports as deepseek_v3, which transformers builds without remote code.
  assert hf.config_to_hf(ours.config)["model_type"] == "deepseek_v3"
