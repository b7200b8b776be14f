"""mb.Model: load_params adapts scanned/unscanned forms and names every bad path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxbridge as mb
from maxbridge.core import canonical
from maxbridge.models import model as model_lib
from maxbridge.training import vocab_tiling
from maxbridge.ops import rotary
from conftest import LINEN_FLAGS, tiny_config

BACKENDS = {"linen": (False, False, False), "nnx": (True, True, True)}


@pytest.fixture(scope="module", params=list(BACKENDS))
def model(request):
  return mb.create_model(tiny_config(BACKENDS[request.param]), seed=0)


def test_load_params_round_trips(model, tokens):
  before = model.logits(tokens)
  params = jax.tree.map(lambda x: x + 0.01, model.params())
  model.load_params(params)
  assert not np.allclose(model.logits(tokens), before)
  for path, leaf in canonical.flatten(model.params()).items():
    np.testing.assert_array_equal(leaf, canonical.flatten(params)[path], err_msg=path)


def test_load_params_accepts_the_unscanned_form(tokens):
  scanned = mb.create_model(tiny_config(scan_layers=True), seed=0)
  unscanned = mb.create_model(tiny_config((True, True, True), scan_layers=False), seed=5)
  unscanned.load_params(scanned.params())
  np.testing.assert_allclose(unscanned.logits(tokens), scanned.logits(tokens), atol=1e-6)
  scanned.load_params(canonical.unstack_layers(scanned.params(), 1))
  np.testing.assert_allclose(unscanned.logits(tokens), scanned.logits(tokens), atol=1e-6)


def test_missing_leaf_is_named(model):
  params = model.params()
  del params["decoder"]["decoder_norm"]
  with pytest.raises(ValueError, match=r"missing: decoder/decoder_norm/scale \(64,\)"):
    model.load_params(params)


def test_extra_leaf_is_named(model):
  params = model.params()
  params["decoder"]["extra"] = {"kernel": jnp.zeros((2, 2))}
  with pytest.raises(ValueError, match="unexpected: decoder/extra/kernel"):
    model.load_params(params)


def test_misshaped_leaf_is_named_with_both_shapes(model):
  params = model.params()
  params["token_embedder"]["embedding"] = jnp.zeros((255, 64))
  with pytest.raises(ValueError, match=r"token_embedder/embedding has shape \(255, 64\), the model expects \(256, 64\)"):
    model.load_params(params)


def test_a_failed_load_leaves_the_parameters_unchanged(model, tokens):
  before = model.logits(tokens)
  params = model.params()
  params["token_embedder"]["embedding"] = jnp.zeros((1, 1))
  with pytest.raises(ValueError):
    model.load_params(params)
  np.testing.assert_array_equal(model.logits(tokens), before)


def test_non_dict_is_refused(model):
  with pytest.raises(TypeError, match="nested dict"):
    model.load_params([1, 2, 3])


def test_hidden_states_are_sown_but_never_parameters(model, tokens):
  logits, intermediates = model.apply_with_intermediates(model.params(), tokens)
  hidden = intermediates["decoder/hidden_states"]
  assert hidden.shape == (2, 16, 64)
  # The sown value is what the output head reads (before its final norm): the
  # head as a function of canonical parameters turns it into the same logits.
  head = vocab_tiling.canonical_head(model.config)
  params = vocab_tiling.head_params(model.config, model.params())
  np.testing.assert_array_equal(logits, head(params, {}, hidden.reshape(-1, 64)).reshape(logits.shape))
  assert not any("hidden_states" in path for path in canonical.flatten(model.params()))


@pytest.mark.parametrize("flags", [(False, True, False), (True, False, True), (True, True, False)])
def test_hidden_states_cross_the_bridge(flags, tokens):
  linen = mb.create_model(tiny_config(), seed=0)
  mixed = mb.create_model(tiny_config(flags), seed=0)
  _, want = linen.apply_with_intermediates(linen.params(), tokens)
  _, got = mixed.apply_with_intermediates(mixed.params(), tokens)
  assert list(got) == ["decoder/hidden_states"]
  np.testing.assert_allclose(got["decoder/hidden_states"], want["decoder/hidden_states"], atol=1e-6)


def test_tokens_must_be_two_dimensional(model):
  with pytest.raises(ValueError, match=r"tokens must be int \[batch, length\], got shape \(16,\)"):
    model.logits(jnp.zeros((16,), jnp.int32))


def test_seven_billion_parameter_preset_builds_abstractly():
  """llama2-7b is never materialised here; its canonical tree is checked by shape only."""
  from maxbridge.models import dispatch

  config = mb.load_config("llama2-7b", **LINEN_FLAGS)
  model = model_lib.LinenModel(config, dispatch.linen_transformer(config), dispatch.sample_inputs(config))
  shapes = canonical.flatten(model.abstract_params())
  assert shapes["decoder/layers/self_attention/query/kernel"].shape == (4096, 32, 32, 128)
  assert shapes["decoder/layers/mlp/wi_0/kernel"].shape == (4096, 32, 11008)
  total = sum(int(np.prod(s.shape)) for s in shapes.values())
  assert 6.7e9 < total < 6.8e9, total


@pytest.mark.parametrize("preset, total", [("llama3.1-8b", 8_030_261_248), ("llama3.1-70b", 70_553_706_496)])
def test_llama3_1_presets_have_the_published_parameter_counts(preset, total):
  """Built abstractly on both backends; the totals are Meta's published counts."""
  from maxbridge.models import dispatch

  config = mb.load_config(preset, **LINEN_FLAGS)
  assert rotary.scaling_from_config(config) == rotary.Llama3Scaling(8.0, 1.0, 4.0, 8192)
  nnx_config = config.replace(pure_nnx=True, enable_nnx=True, pure_nnx_decoder=True)
  linen = model_lib.LinenModel(config, dispatch.linen_transformer(config), dispatch.sample_inputs(config))
  nnx_model = model_lib.NNXModel(nnx_config, nnx.eval_shape(lambda: dispatch.nnx_transformer(nnx_config, nnx.Rngs(0))))
  for model in (linen, nnx_model):
    shapes = canonical.flatten(model.abstract_params())
    assert sum(int(np.prod(s.shape)) for s in shapes.values()) == total


@pytest.mark.parametrize("high", [4.0, 1.0], ids=["llama3.1", "llama4-scout"])
def test_llama3_scaling_equals_transformers_also_with_no_blending_band(high):
  """Llama 4 Scout sets high_freq_factor = low_freq_factor = 1: a band of no width, not a division by zero."""
  from transformers import LlamaConfig
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0}
  rope |= {"high_freq_factor": high, "original_max_position_embeddings": 8192}
  hf = LlamaConfig(hidden_size=1024, num_attention_heads=8, rope_parameters=rope)
  want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf)
  timescale = 500000.0 ** (np.arange(0, 128, 2) / 128)
  got = 1.0 / np.asarray(rotary.Llama3Scaling(16.0, 1.0, high, 8192)(jnp.asarray(timescale, jnp.float32)))
  np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)


def test_a_profile_reads_by_module_on_both_backends(model, tokens):
  """Linen names each module call (flax_profile); NNX's `nnx_models.Module` names each by its class."""
  text = jax.jit(model.apply).lower(model.params(), tokens).as_text(debug_info=True)
  scope = "Attention/dot_product_attention" if model.config.pure_nnx_decoder else "self_attention/dot_product_attention"
  assert scope in text
