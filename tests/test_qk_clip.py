"""QK-Clip on canonical parameters: per layer, per head, scanned == unscanned, unclipped heads untouched."""

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

import maxbridge as mb
from maxbridge import canonical, qk_clip
from maxbridge.config import ConfigError


def _maxima(config, low=0.5, high=3.0):
  """Per stack [layers, heads], distinct per layer so that a shared scale would show."""
  heads = config.num_query_heads
  return {s: jnp.linspace(low, high, n * heads).reshape(n, heads) for s, n in canonical.layer_stacks(config)}


@pytest.mark.parametrize("preset", ["llama-tiny", "deepseek3-tiny", "gpt3-tiny"])
def test_scanned_and_unscanned_clip_identically_per_layer(preset):
  config = dataclasses.replace(mb.load_config(preset), qk_clip_threshold=1.0)
  params = mb.create_model(config, seed=0).params()
  maxima = _maxima(config)
  scanned = canonical.unstack_layers(qk_clip.clip(params, maxima, config), config.param_scan_axis)
  unstacked = canonical.unstack_layers(params, config.param_scan_axis)
  unscanned = qk_clip.clip(unstacked, maxima, config)
  for path, value in canonical.flatten(unscanned).items():
    np.testing.assert_array_equal(canonical.flatten(scanned)[path], value, err_msg=path)


def test_llama_query_heads_scale_by_tau_over_max_and_the_rest_is_bit_identical():
  config = dataclasses.replace(mb.load_config("llama-tiny", scan_layers=False), qk_clip_threshold=1.0)
  params = mb.create_model(config, seed=0).params()
  maxima = _maxima(config)
  clipped = canonical.flatten(qk_clip.clip(params, maxima, config))
  before = canonical.flatten(params)
  for path, value in before.items():
    if not path.endswith("self_attention/query/kernel"):
      np.testing.assert_array_equal(clipped[path], value, err_msg=path)
      continue
    layer = int(path.split("/")[1].removeprefix("layers_"))
    top = np.asarray(maxima["layers"][layer])
    for head in range(config.num_query_heads):
      got, was = clipped[path][:, head], value[:, head]
      if top[head] <= 1.0:
        np.testing.assert_array_equal(got, was, err_msg=f"{path} head {head} is under tau")
      else:
        np.testing.assert_allclose(got, was / top[head], rtol=1e-6, err_msg=f"{path} head {head}")


def test_mla_scales_nope_by_sqrt_and_rope_by_s_and_leaves_values():
  config = dataclasses.replace(mb.load_config("deepseek3-tiny", scan_layers=False), qk_clip_threshold=1.0)
  params = mb.create_model(config, seed=0).params()
  maxima = {s: jnp.full((n, config.num_query_heads), 4.0) for s, n in canonical.layer_stacks(config)}
  clipped = canonical.flatten(qk_clip.clip(params, maxima, config))
  before = canonical.flatten(params)
  nope = config.qk_nope_head_dim
  query = [p for p in before if p.endswith(("self_attention/wq_b/kernel", "self_attention/query/kernel"))][0]
  np.testing.assert_allclose(clipped[query][..., :nope], before[query][..., :nope] * 0.5, rtol=1e-6)
  np.testing.assert_allclose(clipped[query][..., nope:], before[query][..., nope:] * 0.25, rtol=1e-6)
  kv = query.rsplit("/", 2)[0] + "/wkv_b/kernel"
  np.testing.assert_allclose(clipped[kv][..., :nope], before[kv][..., :nope] * 0.5, rtol=1e-6)
  np.testing.assert_array_equal(clipped[kv][..., nope:], before[kv][..., nope:])  # values


def test_qk_norm_refuses_qk_clip_with_the_reason():
  with pytest.raises(ConfigError, match="use_qk_norm"):
    qk_clip.check(mb.load_config("qwen3-tiny"))
