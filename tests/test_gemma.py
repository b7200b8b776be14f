"""Gemma 1 and 2 (decoder_block gemma, gemma2): Hugging Face interchange on both backends, Gemma 2's features.

The references are tiny random `GemmaForCausalLM` / `Gemma2ForCausalLM` models
saved with save_pretrained. Gemma 2's departures (soft-capped attention and
final logits, sliding-window layers alternating with global ones,
query_pre_attn_scalar) are each set where they change the numbers, and
`test_each_gemma2_feature_changes_the_logits` shows that dropping any of them
moves the logits away from transformers'.
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
from conftest import LINEN_FLAGS  # noqa: E402
from hf_family import BACKENDS, TOKENS, Saved, assert_matches_transformers, export_and_reimport  # noqa: E402
from hf_family import family_config  # noqa: E402
from hf_family import TINY  # noqa: E402
from hf_family import highest_precision, int8_logits, tiled_and_untiled_grads  # noqa: E402,F401 (an autouse fixture)
from test_hf import max_diff  # noqa: E402
from test_vocab_tiling import _batch, _grads  # noqa: E402

DIMS = dict(
    **TINY,
    head_dim=16,
    intermediate_size=128,
    rms_norm_eps=1e-6,
)
# Gemma 2 where each feature shows: a window shorter than the sequences, caps near the logits' size,
# a query scalar other than head_dim.
GEMMA2 = dict(
    num_hidden_layers=4,
    num_key_value_heads=2,
    sliding_window=4,
    attn_logit_softcapping=3.0,
    final_logit_softcapping=4.0,
    query_pre_attn_scalar=24,
)
CLASSES = {
    "gemma": (transformers.GemmaConfig, transformers.GemmaForCausalLM, dict(num_hidden_layers=2, num_key_value_heads=1)),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM, GEMMA2),
}


def saved(family: str, folder, **changes) -> Saved:
  """A saved tiny Gemma (1 or 2) and what transformers computes with it."""
  config_class, model_class, dims = CLASSES[family]
  torch.manual_seed(0)
  model = model_class(config_class(**DIMS, **{**dims, **changes}))

  def constant_embed_scale(model):  # a constant buffer (sqrt(hidden_size)), not a weight: randomize drew it too
    with torch.no_grad():
      model.model.embed_tokens.embed_scale.fill_(DIMS["hidden_size"] ** 0.5)

  return Saved(model, folder, prepare=constant_embed_scale)


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory):
  return saved("gemma2", tmp_path_factory.mktemp("gemma2") / "hf")


@pytest.fixture(scope="module", params=list(CLASSES))
def reference(request, tmp_path_factory):
  if request.param == "gemma2":  # the same model as the gemma2 fixture's: built once
    return request.getfixturevalue("gemma2")
  return saved(request.param, tmp_path_factory.mktemp(request.param) / "hf")


# --- Hugging Face ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend, scan_layers", [("linen", True), ("nnx", False), ("nnx", True)], ids=["linen-scanned", "nnx", "nnx-scanned"]
)
def test_imported_logits_and_a_24_token_greedy_continuation_match_transformers(reference, backend, scan_layers):
  model = mb.from_pretrained(reference.folder, backend=backend, scan_layers=scan_layers)
  assert model.config.pure_nnx == (backend == "nnx")
  assert_matches_transformers(model, reference, max_target_length=64)


def test_export_loads_in_transformers_and_reimports_the_same_tree(reference, tmp_path):
  exported, first, again = export_and_reimport(reference, tmp_path, type(reference.model))
  assert exported.config.to_diff_dict() == {**reference.model.config.to_diff_dict(), "dtype": "float32"}
  # The table's sqrt(d) and the norms' + 1 are undone and redone: equal up to float32 rounding.
  for path in first:
    np.testing.assert_allclose(again[path], first[path], rtol=1e-6, atol=1e-7, err_msg=path)


def test_gemma2_blocks_hold_a_local_then_a_global_layer(gemma2):
  reference = gemma2
  model = mb.from_pretrained(reference.folder, backend="nnx", scan_layers=False)
  assert model.config.num_decoder_layers == 2 and model.config.sliding_window_size == 4
  flat = canonical.flatten(model.params())
  # Hugging Face's layer 3 is block 1's global layer; its norm scale holds (1 + w).
  want = reference.model.model.layers[3].post_feedforward_layernorm.weight.detach().numpy() + 1
  np.testing.assert_allclose(flat["decoder/layers_1/post_ffw_norm_global/scale"], want, rtol=1e-6)


@pytest.mark.parametrize(
    "change",
    [
        dict(attn_logits_soft_cap=0.0),
        dict(final_logits_soft_cap=0.0),
        dict(sliding_window_size=64),
        dict(query_pre_attn_scalar=16),
    ],
    ids=lambda change: next(iter(change)),
)
def test_each_gemma2_feature_changes_the_logits(gemma2, change):
  """Without the feature (its key set as if absent) the logits leave transformers' (which the import matches)."""
  without = mb.from_pretrained(gemma2.folder, backend="nnx", **change)
  assert max_diff(without.logits(jnp.asarray(TOKENS, jnp.int32)), gemma2.logits) > 0.05


@pytest.mark.parametrize(
    "family, change, match",
    [
        ("gemma2", dict(num_hidden_layers=3), r"num_hidden_layers=3 with layer_types=.* \(an even number of layers\)"),
        ("gemma2", dict(layer_types=["full_attention"] * 4), r"layer_types=.*sliding_attention then a full_attention"),
        ("gemma2", dict(sliding_window=None), r"sliding_window=null"),
        ("gemma2", dict(hidden_activation="gelu"), r"hidden_activation='gelu' is not supported"),
        ("gemma", dict(hidden_act="silu"), r"hidden_act='silu' is not supported"),
        ("gemma", dict(use_bidirectional_attention=True), r"use_bidirectional_attention=True is not supported"),
    ],
)
def test_configs_we_cannot_compute_are_refused_by_field(family, change, match):
  config_class, _, dims = CLASSES[family]
  raw = config_class(**DIMS, **{**dims, **change}).to_dict()
  raw.update(change)  # as written in config.json (transformers may fill layer_types in)
  with pytest.raises(hf.HFError, match=match):
    hf.config_from_hf(raw)


# --- MaxText's tied-embedding numerics ------------------------------------------------------------


def test_normalize_embedding_logits_divides_the_tied_logits_by_sqrt_d():
  on = mb.create_model(mb.load_config("gemma-tiny", **LINEN_FLAGS), seed=0)
  off = mb.create_model(mb.load_config("gemma-tiny", normalize_embedding_logits=False, **LINEN_FLAGS), seed=0)
  np.testing.assert_allclose(
      np.asarray(on.logits(TOKENS)) * np.sqrt(on.config.emb_dim), off.logits(TOKENS), rtol=1e-5, atol=1e-5
  )


def test_every_tied_preset_reads_its_head_as_its_hugging_face_architecture_does():
  """GPT-2's presets turn MaxText's default off (their numbers must not change); Gemma's keep it."""
  from maxbridge.core.config import PRESET_DIR

  tied = {}
  for preset in sorted(path.stem for path in PRESET_DIR.glob("*.yml")):
    cfg = mb.load_config(preset)
    if cfg.logits_via_embedding:
      tied[preset] = cfg.normalize_embedding_logits
      assert cfg.normalize_embedding_logits == hf.family_for_config(cfg).normalize_embedding_logits, preset
  assert tied["gpt3-tiny"] is False and tied["gpt2"] is False and tied["gemma2-2b"] is True


def test_a_tied_maxtext_config_without_the_key_divides_as_maxtexts_base_yml():
  assert mb.load_config("llama-tiny", logits_via_embedding=True).normalize_embedding_logits is True


def test_an_export_whose_head_reads_otherwise_than_hugging_faces_is_refused():
  cfg = mb.load_config("qwen3-tiny", logits_via_embedding=True, normalize_embedding_logits=True)
  with pytest.raises(hf.HFError, match=r"normalize_embedding_logits=True with a tied head has no Hugging Face qwen3"):
    hf.config_to_hf(cfg)
  cfg = mb.load_config("gemma-tiny", normalize_embedding_logits=False)
  with pytest.raises(hf.HFError, match=r"normalize_embedding_logits=False .* gemma equivalent"):
    hf.config_to_hf(cfg)


# --- config rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "preset, overrides, match",
    [
        ("gemma2-tiny", dict(use_qk_clip=True), r"use_qk_clip=true with attn_logits_soft_cap=50.0: the soft-cap"),
        ("gemma2-tiny", dict(use_qk_clip=True, attn_logits_soft_cap=0.0), r"QK-Clip is not implemented for its blocks"),
        ("gemma2-tiny", dict(sliding_window_size=0), r"decoder_block='gemma2' alternates .* sliding_window_size > 0"),
        ("gemma-tiny", dict(attn_logits_soft_cap=50.0), r"decoder_block='gemma' attends in full"),
        ("gemma-tiny", dict(use_qk_norm=True), r"decoder_block='gemma' has no query/key norms"),
    ],
)
def test_family_rules_are_refused_with_the_reason(preset, overrides, match):
  with pytest.raises(ConfigError, match=match):
    mb.load_config(preset, **overrides)


# --- features on both backends --------------------------------------------------------------------


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_vocab_tiling_gives_the_untiled_soft_capped_loss_and_gradients(backend):
  flags = BACKENDS[backend]
  # A final cap the logits reach, so that a tiled loss that forgot it would differ.
  overrides = dict(z_loss_multiplier=1e-3, per_device_batch_size=2, max_target_length=16, final_logits_soft_cap=0.5)
  (want_loss, want), (loss, grads) = tiled_and_untiled_grads("gemma2-tiny", flags, **overrides)
  uncapped = family_config("gemma2-tiny", flags, **{**overrides, "final_logits_soft_cap": 0.0})
  uncapped_loss, _ = _grads(uncapped, _batch(uncapped))
  assert abs(float(uncapped_loss) - float(want_loss)) > 1e-3
  np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
  for path in want:  # gradients of order 1: atol 1e-5 is float32 summation-order noise through the tanh
    np.testing.assert_allclose(grads[path], want[path], rtol=1e-4, atol=1e-5, err_msg=path)


@pytest.fixture(scope="module")
def lora_losses(tmp_path_factory):
  run = dict(
      lora_rank=4,
      lora_alpha=8.0,
      learning_rate=1e-2,
      per_device_batch_size=2,
      max_target_length=16,
      steps=4,
      eval_interval=0,
      enable_checkpointing=False,
  )
  return {
      backend: [
          record["loss"]
          for record in mb.train(
              family_config("gemma2-tiny", flags, base_output_directory=str(tmp_path_factory.mktemp(backend)), **run),
              progress=False,
          )
      ]
      for backend, flags in BACKENDS.items()
  }


def test_lora_trains_alike_on_both_backends(lora_losses):
  linen, nnx = lora_losses["linen"], lora_losses["nnx"]
  assert all(np.isfinite(linen)) and linen[-1] < linen[0], linen
  np.testing.assert_allclose(nnx, linen, rtol=0, atol=1e-5)


@pytest.mark.parametrize("preset", ["gemma-tiny", "gemma2-tiny"])
def test_aqt_int8_quantizes_alike_on_both_backends(preset):
  float_logits, linen, nnx = int8_logits(preset)
  assert np.all(np.isfinite(linen))
  assert np.abs(linen - float_logits).max() > 1e-3  # int8 rounding moves the logits past float noise
  np.testing.assert_allclose(nnx, linen, atol=1e-6, rtol=0)
