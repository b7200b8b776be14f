"""Llama 4 (decoder_block llama4, text only): Hugging Face interchange on both backends, and its own parts.

The reference is a tiny random `Llama4ForCausalLM` of 4 layers saved with
save_pretrained: one scanned block of three chunked RoPE layers then a NoPE
one, dense and MoE layers alternating (interleave_moe_layer_step=2); the
parity matrix (test_families.py) runs two blocks of llama4-tiny. Its
chunk (4) is shorter than the sequences and its temperature tuning starts at
position 3 (floor_scale=4), so `test_each_llama4_part_changes_the_logits`
shows that dropping the chunks, the NoPE layers, the temperature or the
QK-norm moves the logits away from transformers'.
"""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge.core import canonical  # noqa: E402
from maxbridge.core.config import ConfigError  # noqa: E402
from maxbridge.core.families import llama4  # noqa: E402
from maxbridge.interop import hf  # noqa: E402
from maxbridge.models import decoding, dispatch  # noqa: E402
from maxbridge.ops import attention, moe as moe_ops  # noqa: E402
from hf_family import TINY, TOKENS, Saved, assert_matches_transformers, export_and_reimport  # noqa: E402
from hf_family import BACKENDS, assert_same_tree, family_config  # noqa: E402
from hf_family import highest_precision  # noqa: E402,F401 (an autouse fixture)
from test_hf import max_diff  # noqa: E402

DIMS = dict(
    **TINY,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=32,
    intermediate_size_mlp=96,
    num_hidden_layers=4,
    num_local_experts=4,
    num_experts_per_tok=1,
    interleave_moe_layer_step=2,
    attention_chunk_size=4,
    attn_temperature_tuning=True,
    floor_scale=4,
    attn_scale=0.5,
    use_qk_norm=True,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  torch.manual_seed(0)
  model = transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**DIMS))
  return Saved(model, tmp_path_factory.mktemp("llama4") / "hf")


@pytest.fixture(scope="module")
def imported(reference):
  return mb.from_pretrained(reference.folder, backend="nnx", scan_layers=False)


# --- Hugging Face ---------------------------------------------------------------------------------


# Scanned NNX and unscanned Linen give these same logits: the parity matrix (test_families.py).
@pytest.mark.parametrize("backend, scan_layers", [("linen", True), ("nnx", False)], ids=["linen-scanned", "nnx"])
def test_imported_logits_and_a_24_token_greedy_continuation_match_transformers(reference, backend, scan_layers):
  """The 5-token prompts and 24 new tokens cross seven chunk boundaries; the engine prefills in pieces of 8."""
  model = mb.from_pretrained(reference.folder, backend=backend, scan_layers=scan_layers)
  assert model.config.pure_nnx == (backend == "nnx")
  assert_matches_transformers(model, reference, max_target_length=64)


def test_export_loads_in_transformers_and_reimports_the_same_tree(reference, tmp_path):
  exported, first, again = export_and_reimport(reference, tmp_path, transformers.Llama4ForCausalLM)
  want = reference.model.config.to_diff_dict()
  got = exported.config.to_diff_dict()
  for key in ("no_rope_layers", "moe_layers", "layer_types", "attention_chunk_size", "floor_scale", "attn_scale"):
    assert got[key] == want[key], key
  assert_same_tree(first, again)


def test_layers_stack_as_blocks_of_three_chunked_rope_layers_then_a_nope_one(reference, imported):
  model = imported
  cfg = model.config
  assert (cfg.chunk_attn_window_size, cfg.nope_layer_interval, cfg.interleave_moe_layer_step) == (4, 4, 2)
  assert (cfg.temperature_tuning, cfg.temperature_tuning_scale, cfg.temperature_tuning_floor_scale) == (True, 0.5, 4.0)
  assert canonical.layer_stacks(cfg) == (("layers", 1),)
  flat = canonical.flatten(model.params())
  layers = reference.model.model.layers
  # Hugging Face's layer 3 is the block's NoPE layer, an MoE one; layer 0 the block's first, a dense one.
  experts = layers[3].feed_forward.experts
  # MaxText's names: the fused gate_up_proj [E, D, 2F] split into wi_0 (gate) and wi_1 (up).
  gate, up = np.split(experts.gate_up_proj.detach().numpy(), 2, axis=-1)
  np.testing.assert_array_equal(flat["decoder/layers_0/nope/Llama4MoEBlock_0/MoeBlock_0/wi_0"], gate)
  np.testing.assert_array_equal(flat["decoder/layers_0/nope/Llama4MoEBlock_0/MoeBlock_0/wi_1"], up)
  assert "decoder/layers_0/nope/Llama4MoEBlock_0/MoeBlock_0/wi" not in flat
  dense = layers[0].feed_forward.down_proj.weight.detach().numpy().T
  np.testing.assert_array_equal(flat["decoder/layers_0/rope_0/mlp/wo/kernel"], dense)
  assert not any(path.startswith("decoder/layers_0/rope_0/Llama4MoEBlock_0") for path in flat)
  assert [layer.self_attn.use_rope for layer in layers] == [1, 1, 1, 0]
  assert [layer.is_moe_layer for layer in layers] == [False, True] * 2


@pytest.mark.parametrize(
    "change",
    [
        dict(chunk_attn_window_size=64),  # no chunk boundary within the sequence
        dict(temperature_tuning=False),
        dict(use_qk_norm=False),
    ],
    ids=lambda change: next(iter(change)),
)
def test_each_llama4_part_changes_the_logits(reference, change):
  """Without the part the logits leave transformers' (which the import matches)."""
  without = mb.from_pretrained(reference.folder, backend="nnx", **change)
  assert max_diff(without.logits(jnp.asarray(TOKENS, jnp.int32)), reference.logits) > 0.05


def test_without_nope_layers_the_logits_leave_transformers(reference, imported, monkeypatch):
  """Every layer rotating (and chunking): the NoPE layers are what makes the import match."""
  monkeypatch.setattr(llama4, "uses_rope", lambda sublayer: True)  # the same tree: NoPE layers own no parameter
  # An NNX module reads it as it is built: built anew, not merged from the one built for this config before.
  monkeypatch.setattr(dispatch, "_abstract_nnx", dispatch._abstract_nnx.__wrapped__)
  without = mb.create_model(imported.config, params=imported.params())
  assert max_diff(without.logits(jnp.asarray(TOKENS, jnp.int32)), reference.logits) > 0.05


# --- the math -------------------------------------------------------------------------------------


def test_chunked_mask_sees_only_its_own_chunk_causally():
  positions = jnp.arange(8, dtype=jnp.int32)[None]
  segments = jnp.ones_like(positions)
  mask = np.asarray(attention.attention_mask(segments, segments, positions, positions, chunk_size=3))[0, 0, 0]
  want = np.array([[j <= i and j // 3 == i // 3 for j in range(8)] for i in range(8)])
  np.testing.assert_array_equal(mask, want)


def test_temperature_tuning_is_transformers_formula():
  positions = jnp.asarray([[0, 2, 3, 7, 8191, 100000]], jnp.int32)
  got = np.asarray(attention.temperature_tuning(positions, 0.1, 8192.0))[0, :, 0, 0]
  want = np.log1p(np.floor((np.asarray(positions[0], np.float64) + 1) / 8192.0)) * 0.1 + 1
  np.testing.assert_allclose(got, want, rtol=1e-6)
  assert got[0] == 1.0 and got[-1] > 1.2


@pytest.mark.parametrize("sparse", [True, False], ids=["dropless", "dense"])
def test_the_router_score_scales_each_chosen_experts_input(sparse):
  """Llama 4 multiplies the expert's input by sigmoid(logit), which a SwiGLU does not pass through linearly."""
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(1, 5, 8)), jnp.float32)
  logits = jnp.asarray(rng.normal(size=(1, 5, 3)), jnp.float32)
  wi_0, wi_1 = (jnp.asarray(rng.normal(size=(3, 8, 6)), jnp.float32) for _ in range(2))
  wo = jnp.asarray(rng.normal(size=(3, 6, 8)), jnp.float32)
  out, _ = moe_ops.routed_moe(
      x, logits, None, wi_0, wi_1, wo, num_experts_per_tok=1, score_func="topk_sigmoid", sparse=sparse
  )
  expert = np.argmax(logits[0], axis=-1)
  score = 1 / (1 + np.exp(-np.max(logits[0], axis=-1)))
  for t in range(5):
    e, h = expert[t], x[0, t] * score[t]
    gate = h @ wi_0[e]
    want = (gate / (1 + np.exp(-gate)) * (h @ wi_1[e])) @ wo[e]
    np.testing.assert_allclose(out[0, t], want, rtol=1e-5, atol=1e-5)


# --- the engine -----------------------------------------------------------------------------------


def test_cached_decode_equals_recompute_past_chunk_boundaries():
  """Greedy decode through the cache (chunked layers masking the cached keys of earlier chunks) gives the
  tokens that recomputing the whole sequence gives, across four chunk boundaries. (Both backends, and the
  engine's slots: test_engine.py's family list; Linen vs NNX: the parity matrix.)"""
  config = family_config("llama4-tiny", BACKENDS["nnx"], chunk_attn_window_size=4, base_num_decoder_layers=4)
  model = mb.create_model(config, seed=0)
  # Decode reads at most a chunk on the RoPE layers: a ring of one chunk, which the 6-token prompt already wraps.
  cache = canonical.flatten(decoding.abstract_cache(model.config, 1, 64))
  lengths = {path.split("/")[-3]: leaf.shape[-1] for path, leaf in cache.items() if path.endswith("/cache_positions")}
  assert lengths == {"rope_0": 4, "rope_1": 4, "rope_2": 4, "nope": 64}
  prompt = np.array([[5, 9, 200, 17, 3, 88]], np.int64)
  cached = np.asarray(model.generate(prompt, max_new_tokens=12))
  # One forward over the whole continuation: each position's argmax is the token the cache decoded next.
  recomputed = np.asarray(model.logits(jnp.asarray(cached[:, :-1], jnp.int32))).argmax(-1)
  np.testing.assert_array_equal(cached[:, prompt.shape[1] :], recomputed[:, prompt.shape[1] - 1 :])


# --- config rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(use_qk_clip=True, use_qk_norm=False), r"use_qk_clip=true with decoder_block='llama4'"),
        (dict(use_qk_clip=True), r"use_qk_clip=true with use_qk_norm=true"),
        (dict(base_num_decoder_layers=6), r"base_num_decoder_layers=6 must be a multiple of 4"),
        (dict(nope_layer_interval=2), r"nope_layer_interval=2 must be 4"),
        (dict(interleave_moe_layer_step=3), r"interleave_moe_layer_step=3 must be one of \(1, 2, 4\)"),
        (dict(chunk_attn_window_size=0), r"set chunk_attn_window_size > 0"),
        (dict(routed_score_func="softmax"), r"routed_score_func='softmax'"),
        (dict(num_experts=1), r"num_experts must be >= 2"),
    ],
    ids=["qk-clip", "qk-clip-qk-norm", "layers", "nope", "moe-step", "chunk", "routing", "experts"],
)
def test_family_rules_are_refused_with_the_reason(overrides, match):
  with pytest.raises(ConfigError, match=match):
    mb.load_config("llama4-tiny", **overrides)


@pytest.mark.parametrize("key, value", [("chunk_attn_window_size", 8), ("temperature_tuning", True)])
def test_other_families_refuse_llama4_keys(key, value):
  with pytest.raises(ConfigError, match=rf"{key}={value!r} is read by decoder_block='llama4' only"):
    mb.load_config("llama-tiny", **{key: value})


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(no_rope_layers=[1, 0] * 2), r"no_rope_layers=.*NoPE layer every 4"),
        (dict(moe_layers=[0, 3]), r"moe_layers=\[0, 3\]"),
        (dict(interleave_moe_layer_step=3, moe_layers=None), r"interleave_moe_layer_step=3"),
        (dict(attention_chunk_size=None), r"attention_chunk_size=None must be a positive integer"),
        (dict(attention_bias=True), r"attention_bias"),
    ],
    ids=["no_rope_layers", "moe_layers", "moe-step", "chunk", "bias"],
)
def test_configs_we_cannot_compute_are_refused_by_field(change, match):
  raw = {**transformers.Llama4TextConfig(**DIMS).to_dict(), **change}
  with pytest.raises(hf.HFError, match=match):
    hf.config_from_hf(raw)


def test_the_scout_preset_has_its_real_size_abstractly():
  """Llama 4 Scout: 109B parameters in all (17B active), 12 blocks of four MoE layers."""
  cfg = mb.load_config("llama4-scout-17b-16e")
  assert canonical.layer_stacks(cfg) == (("layers", 12),)
  leaves = canonical.flatten(dispatch.abstract_model(cfg).abstract_params()).values()
  total = sum(int(np.prod(leaf.shape)) for leaf in leaves)
  assert 107e9 < total < 110e9, total
