"""OLMo 2 (decoder_block olmo2): Hugging Face interchange on both backends, its QK-norm, and every feature.

The reference is a tiny random `Olmo2ForCausalLM` saved with save_pretrained.
OLMo 2's two departures from Llama are checked where they change the numbers:
the post-branch norms (every logit comparison with transformers) and the
QK-norm over the whole projection, which makes the relative size of the heads
matter (`test_scaling_one_query_head_changes_olmo2_as_transformers_computes_it`).
"""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge.core.config import ConfigError  # noqa: E402
from maxbridge.interop import hf  # noqa: E402
from maxbridge.models import lora  # noqa: E402
from maxbridge.ops import normalization  # noqa: E402
from conftest import LINEN  # noqa: E402
from hf_family import BACKENDS, TOKENS, Saved, assert_matches_transformers, assert_same_tree  # noqa: E402
from hf_family import export_and_reimport, family_config, int8_logits  # noqa: E402
from hf_family import TINY  # noqa: E402
from hf_family import highest_precision  # noqa: E402,F401 (an autouse fixture)
from test_hf import LOGITS_TOL, max_diff  # noqa: E402

DIMS = dict(
    **TINY,
    num_hidden_layers=2,
    num_key_value_heads=2,
    intermediate_size=128,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 5e5},
)


def saved(folder, scaled_head: float = 1.0) -> Saved:
  """A saved tiny random OLMo 2; `scaled_head` multiplies query head 0's projection in every layer."""
  torch.manual_seed(0)
  model = transformers.Olmo2ForCausalLM(transformers.Olmo2Config(**DIMS))
  head_dim = DIMS["hidden_size"] // DIMS["num_attention_heads"]

  def scale_head(model):
    with torch.no_grad():
      for layer in model.model.layers:
        layer.self_attn.q_proj.weight[:head_dim] *= scaled_head

  return Saved(model, folder, prepare=scale_head)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  return saved(tmp_path_factory.mktemp("olmo2") / "hf")


@pytest.fixture(scope="module")
def imported(reference):
  """The reference imported on each backend (Linen scanned, NNX unscanned)."""
  return {
      "linen": mb.from_pretrained(reference.folder, backend="linen", scan_layers=True),
      "nnx": mb.from_pretrained(reference.folder, backend="nnx", scan_layers=False),
  }


# --- Hugging Face ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_imported_logits_and_a_24_token_greedy_continuation_match_transformers(reference, imported, backend):
  model = imported[backend]
  assert model.config.decoder_block == "olmo2" and model.config.pure_nnx == (backend == "nnx")
  assert_matches_transformers(model, reference)


def test_export_loads_in_transformers_and_reimports_the_same_tree(reference, tmp_path):
  _, first, again = export_and_reimport(reference, tmp_path, transformers.Olmo2ForCausalLM)
  assert first["decoder/layers_0/self_attention/query_norm/scale"].shape == (64,)  # all heads, as Hugging Face's
  assert_same_tree(first, again)


def test_scaling_one_query_head_changes_olmo2_as_transformers_computes_it(reference, tmp_path):
  """A per-head norm would undo the factor; OLMo 2's norm over the whole projection does not."""
  scaled = saved(tmp_path / "hf", scaled_head=4.0)
  assert max_diff(scaled.logits, reference.logits) > 0.1
  for backend in BACKENDS:
    model = mb.from_pretrained(scaled.folder, backend=backend)
    assert max_diff(model.logits(jnp.asarray(TOKENS, jnp.int32)), scaled.logits) <= LOGITS_TOL, backend


def test_the_qk_norm_spans_every_head_of_a_token(reference):
  attention = reference.model.model.layers[0].self_attn
  x = torch.randn(2, 5, DIMS["hidden_size"], generator=torch.Generator().manual_seed(1))
  with torch.no_grad():
    projected = attention.q_proj(x)
    want = attention.q_norm(projected).numpy()
  heads = projected.numpy().reshape(2, 5, DIMS["num_attention_heads"], -1)
  scale = attention.q_norm.weight.detach().numpy()
  got = normalization.rms_norm_across_heads(heads, scale, epsilon=1e-6, dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(got).reshape(want.shape), want, atol=1e-6)
  per_head = normalization.rms_norm(heads, scale.reshape(heads.shape[-2:]), epsilon=1e-6, dtype=jnp.float32)
  assert max_diff(np.asarray(per_head).reshape(want.shape), want) > 0.05


def test_an_olmo2_export_with_a_sliding_window_is_refused():
  cfg = mb.load_config("olmo2-tiny", sliding_window_size=4)
  with pytest.raises(hf.HFError, match="sliding_window_size=4: Hugging Face's olmo2 attends in full"):
    hf.family_for_config(cfg).config_to_hf(cfg)


# --- config rules ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(use_qk_clip=True), r"use_qk_clip=true with use_qk_norm=true: the query/key RMSNorm undoes"),
        (dict(use_qk_norm=False), r"decoder_block='olmo2' normalises queries and keys .* set use_qk_norm=true"),
    ],
)
def test_qk_clip_and_a_missing_qk_norm_are_refused_with_the_reason(overrides, match):
  with pytest.raises(ConfigError, match=match):
    mb.load_config("olmo2-tiny", **overrides)


# --- features on both backends, OLMo 2 and OLMo 3 ------------------------------------------------

PRESETS = ["olmo2-tiny", "olmo3-tiny"]


# OLMo 3's block holds OLMo 2's layers, windowed: its run adapts every kernel OLMo 2's would.
LORA_PRESETS = ["olmo3-tiny"]


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
  """{(preset, backend): (losses, adapter paths)} of a short LoRA run with the default lora_module_path."""
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
  runs = {}
  for preset in LORA_PRESETS:
    for backend, flags in BACKENDS.items():
      config = family_config(preset, flags, base_output_directory=str(tmp_path_factory.mktemp(backend)), **run)
      runs[preset, backend] = [record["loss"] for record in mb.train(config, progress=False)]
  return runs


@pytest.mark.parametrize("preset", LORA_PRESETS)
def test_lora_trains_alike_on_both_backends(lora_runs, preset):
  linen, nnx = lora_runs[preset, "linen"], lora_runs[preset, "nnx"]
  assert all(np.isfinite(linen)) and linen[-1] < linen[0], linen
  np.testing.assert_allclose(nnx, linen, rtol=0, atol=1e-5)


def test_the_default_lora_targets_reach_every_layer_of_an_olmo3_block():
  config = family_config("olmo3-tiny", LINEN, lora_rank=4)
  targets = lora.targets(config, mb.create_model(family_config("olmo3-tiny", LINEN), seed=0).abstract_params())
  for sublayer in ("local_0", "local_1", "local_2", "global"):
    assert f"decoder/layers/{sublayer}/self_attention/query/kernel" in targets, sorted(targets)
    assert f"decoder/layers/{sublayer}/mlp/wo/kernel" in targets, sorted(targets)


@pytest.mark.parametrize("preset", PRESETS)
def test_aqt_int8_quantizes_alike_on_both_backends(preset):
  float_logits, linen, nnx = int8_logits(preset)
  assert np.all(np.isfinite(linen))
  assert np.abs(linen - float_logits).max() > 1e-3  # int8 rounding moves the logits past float noise
  np.testing.assert_allclose(nnx, linen, atol=1e-6, rtol=0)
