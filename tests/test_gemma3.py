"""Gemma 3 (decoder_block gemma3, text only): Hugging Face interchange on both backends, its own features.

The reference is a tiny random `Gemma3ForCausalLM` of 7 layers saved with
save_pretrained: one scanned block of five sliding-window layers and a global
one, and one sliding-window layer in the remainder stack. Its window is
shorter than the sequences, its two layer kinds turn at very different RoPE
thetas, its global layers scale RoPE linearly and its query scalar is not
head_dim, so `test_each_gemma3_feature_changes_the_logits` shows that
dropping any of them moves the logits away from transformers'.
"""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge.core import canonical  # noqa: E402
from maxbridge.core.config import ConfigError  # noqa: E402
from maxbridge.interop import hf  # noqa: E402
from maxbridge.ops import rotary  # noqa: E402
from hf_family import BACKENDS, TOKENS, Saved, assert_matches_transformers, family_config  # noqa: E402
from hf_family import export_and_reimport, tiled_and_untiled_grads  # noqa: E402
from hf_family import highest_precision  # noqa: E402,F401 (an autouse fixture)
from test_hf import max_diff  # noqa: E402

HIDDEN = 64
ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0},
}
DIMS = dict(
    hidden_size=HIDDEN,
    vocab_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    num_hidden_layers=7,
    sliding_window=4,
    query_pre_attn_scalar=24,
    rope_parameters=ROPE,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
)


def constant_embed_scale(model):  # a constant buffer (sqrt(hidden_size)), not a weight: randomize drew it too
  with torch.no_grad():
    model.model.embed_tokens.embed_scale.fill_(HIDDEN**0.5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  torch.manual_seed(0)
  model = transformers.Gemma3ForCausalLM(transformers.Gemma3TextConfig(**DIMS))
  return Saved(model, tmp_path_factory.mktemp("gemma3") / "hf", prepare=constant_embed_scale)


# --- Hugging Face ---------------------------------------------------------------------------------


# Scanned NNX and unscanned Linen give these same logits: the parity matrix (test_families.py).
@pytest.mark.parametrize("backend, scan_layers", [("linen", True), ("nnx", False)], ids=["linen-scanned", "nnx"])
def test_imported_logits_and_a_24_token_greedy_continuation_match_transformers(reference, backend, scan_layers):
  model = mb.from_pretrained(reference.folder, backend=backend, scan_layers=scan_layers)
  assert model.config.pure_nnx == (backend == "nnx")
  assert_matches_transformers(model, reference, max_target_length=64)


def test_export_loads_in_transformers_and_reimports_the_same_tree(reference, tmp_path):
  exported, first, again = export_and_reimport(reference, tmp_path, transformers.Gemma3ForCausalLM)
  assert exported.config.to_diff_dict() == {**reference.model.config.to_diff_dict(), "dtype": "float32"}
  # The table's sqrt(d) and the norms' + 1 are undone and redone: equal up to float32 rounding.
  for path in first:
    np.testing.assert_allclose(again[path], first[path], rtol=1e-6, atol=1e-7, err_msg=path)


def test_layers_stack_as_blocks_of_six_then_a_remainder_of_sliding_window_layers(reference):
  model = mb.from_pretrained(reference.folder, backend="nnx", scan_layers=False)
  cfg = model.config
  assert (cfg.num_decoder_layers, cfg.sliding_window_size, cfg.use_qk_norm) == (7, 4, True)
  assert (cfg.local_rope_max_timescale, cfg.rope_max_timescale, cfg.rope_linear_scaling_factor) == (100, 10000, 4.0)
  assert canonical.layer_stacks(cfg) == (("layers", 1), ("layers_remainder", 1))
  flat = canonical.flatten(model.params())
  layers = reference.model.model.layers
  # Hugging Face's layer 5 is the block's global layer, layer 6 the remainder's; norm scales hold (1 + w).
  for hf_layer, ours in ((5, "layers_0/global"), (6, "layers_remainder_0"), (0, "layers_0/local_0")):
    want = layers[hf_layer].self_attn.k_norm.weight.detach().numpy() + 1
    np.testing.assert_allclose(flat[f"decoder/{ours}/self_attention/key_norm/scale"], want, rtol=1e-6)
  assert [layer.self_attn.sliding_window for layer in layers] == [4] * 5 + [None, 4]


@pytest.mark.parametrize(
    "change",
    [
        dict(sliding_window_size=64),  # no window
        dict(local_rope_max_timescale=10000),  # the local layers at the global layers' theta
        dict(rope_linear_scaling_factor=1.0),  # the global layers unscaled
        dict(query_pre_attn_scalar=16),  # head_dim
    ],
    ids=lambda change: next(iter(change)),
)
def test_each_gemma3_feature_changes_the_logits(reference, change):
  """Without the feature the logits leave transformers' (which the import matches)."""
  without = mb.from_pretrained(reference.folder, backend="nnx", **change)
  assert max_diff(without.logits(jnp.asarray(TOKENS, jnp.int32)), reference.logits) > 0.05


def test_a_hub_config_with_the_legacy_rope_fields_reads_as_transformers_builds_it():
  """google/gemma-3-4b-pt's text config: rope_theta, rope_local_base_freq, a linear rope_scaling, a window pattern."""
  raw = {
      "model_type": "gemma3_text",
      **{key: DIMS[key] for key in ("hidden_size", "vocab_size", "num_attention_heads", "head_dim")},
      "num_hidden_layers": 8,
      "intermediate_size": 128,
      "rope_theta": 1000000.0,
      "rope_local_base_freq": 10000.0,
      "rope_scaling": {"rope_type": "linear", "factor": 8.0},
      "sliding_window_pattern": 6,
      "sliding_window": 1024,
  }
  built = transformers.Gemma3TextConfig(**{k: v for k, v in raw.items() if k != "model_type"})
  assert built.rope_parameters["full_attention"]["factor"] == 8.0
  ours = hf.config_from_hf(raw)
  assert (ours.rope_max_timescale, ours.local_rope_max_timescale, ours.rope_linear_scaling_factor) == (
      int(built.rope_parameters["full_attention"]["rope_theta"]),
      int(built.rope_parameters["sliding_attention"]["rope_theta"]),
      8.0,
  )
  assert hf.config_to_hf(ours)["layer_types"] == built.layer_types


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(layer_types=["full_attention"] * 7), r"layer_types=.*5 sliding_attention layers then a full_attention"),
        (
            dict(layer_types=None, sliding_window_pattern=4),
            r"num_hidden_layers=7 with layer_types=.*sliding_window_pattern",
        ),
        (dict(sliding_window=None), r"sliding_window=None must be a positive integer"),
        (dict(hidden_activation="gelu"), r"hidden_activation='gelu' is not supported"),
        (
            dict(
                rope_parameters={**ROPE, "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}
            ),
            r"rope_parameters.sliding_attention .* rope_type='linear'",
        ),
        (dict(use_bidirectional_attention=True), r"use_bidirectional_attention=True is not supported"),
    ],
    ids=["layer_types", "sliding_window_pattern", "sliding_window", "hidden_activation", "local-rope", "bidirectional"],
)
def test_configs_we_cannot_compute_are_refused_by_field(change, match):
  raw = {**transformers.Gemma3TextConfig(**DIMS).to_dict(), **change}
  with pytest.raises(hf.HFError, match=match):
    hf.config_from_hf(raw)


def test_linear_rope_scaling_rotates_as_positions_divided_by_the_factor():
  x = jnp.asarray(np.random.default_rng(0).normal(size=(1, 6, 2, 8)), jnp.float32)
  positions = jnp.arange(6, dtype=jnp.int32)[None] * 4
  scaled = rotary.apply_rotary(x, positions, max_timescale=100.0, scaling=rotary.LinearScaling(4.0))
  np.testing.assert_allclose(scaled, rotary.apply_rotary(x, positions // 4, max_timescale=100.0), atol=1e-6)
  assert max_diff(scaled, rotary.apply_rotary(x, positions, max_timescale=100.0)) > 0.1


# --- config rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, overrides, match",
    [
        ("gemma3-tiny", dict(use_qk_clip=True), r"use_qk_clip=true with use_qk_norm=true: the query/key RMSNorm"),
        ("gemma3-tiny", dict(use_qk_norm=False), r"decoder_block='gemma3' normalises each head's queries and keys"),
        ("gemma3-tiny", dict(sliding_window_size=0), r"decoder_block='gemma3' gives 5 of every 6 layers a sliding"),
        ("gemma3-tiny", dict(rope_type="yarn"), r"rope_type='yarn' with decoder_block='gemma3'"),
        ("gemma2-tiny", dict(local_rope_max_timescale=100), r"decoder_block='gemma2' rotates every layer alike"),
        ("llama-tiny", dict(rope_linear_scaling_factor=2.0), r"decoder_block='llama2' rotates every layer alike"),
        ("gemma3-tiny", dict(local_rope_max_timescale=0), r"local_rope_max_timescale.*-1 for rope_max_timescale"),
    ],
)
def test_family_rules_are_refused_with_the_reason(preset, overrides, match):
  with pytest.raises(ConfigError, match=match):
    mb.load_config(preset, **overrides)


@pytest.mark.parametrize("preset, blocks, remainder", [("gemma3-1b", 4, 2), ("gemma3-4b", 5, 4), ("gemma3-tiny", 1, 1)])
def test_real_size_presets_stack_their_layers_as_maxtext_counts_them(preset, blocks, remainder):
  cfg = mb.load_config(preset)
  assert canonical.layer_stacks(cfg) == (("layers", blocks), ("layers_remainder", remainder))
  assert len(canonical.layer_paths(cfg)) == cfg.num_decoder_layers


# --- features on both backends --------------------------------------------------------------------

# One sliding-window layer (the remainder stack alone) keeps these quick: what they check is the head,
# the quantized and adapted projections of a Gemma 3 layer and the stack's paths; the six-layer block
# is the parity matrix's (test_families.py) and the Hugging Face tests' above.
ONE_LAYER = dict(base_num_decoder_layers=1, per_device_batch_size=2, max_target_length=16)


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_vocab_tiling_gives_the_untiled_soft_capped_loss_and_gradients(backend):
  # A final cap the logits reach, so that a tiled loss that forgot it would differ.
  (want_loss, want), (loss, grads) = tiled_and_untiled_grads(
      "gemma3-tiny", BACKENDS[backend], final_logits_soft_cap=0.5, z_loss_multiplier=1e-3, **ONE_LAYER
  )
  assert any(path.startswith("decoder/layers_remainder/") for path in grads)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for path in want:  # gradients of order 1: atol 1e-5 is float32 summation-order noise through the tanh
    np.testing.assert_allclose(grads[path], want[path], rtol=1e-4, atol=1e-5, err_msg=path)


def test_aqt_int8_quantizes_alike_on_both_backends():
  def logits(flags, **overrides):
    config = family_config("gemma3-tiny", flags, **ONE_LAYER, **overrides)
    return np.asarray(mb.create_model(config, seed=0).logits(TOKENS[:, :8]))

  float_logits, linen, nnx = (
      logits(BACKENDS["linen"]),
      logits(BACKENDS["linen"], quantization="int8"),
      logits(BACKENDS["nnx"], quantization="int8"),
  )
  assert np.all(np.isfinite(linen))
  assert np.abs(linen - float_logits).max() > 1e-3  # int8 rounding moves the logits past float noise
  np.testing.assert_allclose(nnx, linen, atol=1e-6, rtol=0)


def test_lora_trains_alike_on_both_backends(tmp_path):
  run = dict(lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, steps=3, eval_interval=0, enable_checkpointing=False)
  losses = {}
  for backend, flags in BACKENDS.items():
    config = family_config("gemma3-tiny", flags, base_output_directory=str(tmp_path / backend), **ONE_LAYER, **run)
    losses[backend] = [record["loss"] for record in mb.train(config, progress=False)]
  assert all(np.isfinite(losses["linen"])) and losses["linen"][-1] < losses["linen"][0], losses
  np.testing.assert_allclose(losses["nnx"], losses["linen"], rtol=0, atol=1e-5)


def test_an_export_with_an_attention_soft_cap_is_refused():
  """transformers' Gemma 3 never applies attn_logit_softcapping, so no config.json could carry one."""
  with pytest.raises(hf.HFError, match=r"attn_logits_soft_cap=50.0 has no .* never applies attn_logit_softcapping"):
    hf.config_to_hf(mb.load_config("gemma3-tiny", attn_logits_soft_cap=50.0))
