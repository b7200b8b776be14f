"""The int8 KV cache (`quantize_kvcache`): greedy decoding agrees with the float cache, in half the bytes."""

import logging

import jax
import numpy as np
import pytest

import maxbridge as mb
from conftest import LINEN, tiny_config
from maxbridge.models import decoding, dispatch
from maxbridge.ops import kv_cache
from maxbridge.serving import engine

NNX = (True, True, True)
PROMPT = np.array([5, 9, 200, 17, 3], np.int32)


@pytest.mark.parametrize("flags", [LINEN, NNX], ids=["linen", "nnx"])
def test_greedy_continuations_match_the_float_cache(flags):
  config = tiny_config(flags, per_device_batch_size=1)
  model = dispatch.create_model(config)
  float_cache = engine.generate_continuation(config, model, PROMPT, 16)
  int8_cache = engine.generate_continuation(config.replace(quantize_kvcache=True), model, PROMPT, 16)
  np.testing.assert_array_equal(int8_cache, float_cache)


def test_keys_and_values_are_stored_int8_with_a_scale_per_token_and_head():
  config = tiny_config(quantize_kvcache=True)
  layer = kv_cache.abstract(config, 2, 64)
  assert layer["cached_key"].dtype == np.int8 and layer["cached_key"].shape == (2, 2, 16, 64)  # [B, K, H, S]
  assert layer["cached_key_scale"].shape == (2, 2, 1, 64) and layer["cached_key_scale"].dtype == np.float32
  assert layer["cached_value_scale"].shape == (2, 2, 64, 1)  # values are [B, K, S, H]

  def kv_bytes(config, scales: bool):
    leaves = canonical_leaves(decoding.abstract_cache(config, 8, 64))
    return sum(
        leaf.size * leaf.dtype.itemsize
        for name, leaf in leaves
        if name in ("cached_key", "cached_value") or (scales and kv_cache.is_scale(name))
    )

  bf16, fp32 = tiny_config(dtype="bfloat16"), tiny_config()
  int8 = bf16.replace(quantize_kvcache=True)
  # The keys and values themselves: half of bfloat16's bytes, a quarter of float32's.
  assert 2 * kv_bytes(int8, scales=False) == kv_bytes(bf16, scales=False)
  assert 4 * kv_bytes(int8, scales=False) == kv_bytes(fp32, scales=False)
  # With their scales (one bfloat16 per token and head): 1 + 2 / head_dim bytes per element, vs 2 for bfloat16.
  head_dim = bf16.head_dim
  assert kv_bytes(int8, scales=True) * 2 * head_dim == kv_bytes(bf16, scales=False) * (head_dim + 2)


def canonical_leaves(tree):
  return [(path[-1].key, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree)]


def test_quantize_round_trips_within_half_a_step():
  x = jax.random.normal(jax.random.key(0), (2, 3, 5, 16))
  values, scale = kv_cache.quantize(x, 3, np.float32)
  assert values.dtype == np.int8 and scale.shape == (2, 3, 5, 1)
  assert np.all(np.abs(values * scale - x) <= scale / 2 + 1e-7)
  assert int(np.abs(values).max(axis=3).min()) == 127  # each token and head uses the whole range


def test_an_unknown_kv_quant_dtype_is_refused():
  with pytest.raises(ValueError, match="kv_quant_dtype"):
    tiny_config(quantize_kvcache=True, kv_quant_dtype="int4")


def test_qwen3_next_quantizes_its_attention_cache_and_says_its_deltanet_state_stays_float32(caplog):
  config = mb.load_config("qwen3-next-tiny", quantize_kvcache=True, per_device_batch_size=1, max_prefill_predict_length=8)
  with caplog.at_level(logging.INFO, logger="absl"):
    eng = engine.Engine(config)
  dtypes = {}
  for name, leaf in canonical_leaves(eng.init_decode_state().cache):
    dtypes.setdefault(name, set()).add(leaf.dtype)
  assert dtypes["cached_key"] == dtypes["cached_value"] == {np.dtype(np.int8)}, dtypes
  assert dtypes[kv_cache.RECURRENT_STATE] == dtypes[kv_cache.CONV_WINDOW] == {np.dtype(np.float32)}, dtypes
  assert "states stay float: conv_window float32, recurrent_state float32" in caplog.text
