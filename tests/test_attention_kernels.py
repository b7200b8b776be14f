"""Each kernel the `attention` key picks (`ops.attention.KERNELS`) computes dot_product_attention's result.

`flash` (`ops.flash_attention`: blockwise, online softmax, its own VJP) is
compared with `dot_product` in float32 to 1e-5, outputs, QK-Clip's max logits
and gradients w.r.t. query, key, value and sinks, at tiny blocks (4 queries, 8
keys) over lengths that are not multiples of them, so every case crosses block
edges, pads, and skips fully masked blocks. Each case is one compile per kernel.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh

from maxbridge.core import sharding
from maxbridge.ops import attention, flash_attention
from conftest import assert_flash_gives_dot_products_logits

TOL = dict(rtol=1e-5, atol=1e-5)
BLOCKS = dict(block_q=4, block_kv=8)
BATCH, LENGTH, HEADS, KV_HEADS, HEAD_DIM = 2, 13, 4, 2, 8  # GQA: two query heads per kv head

rng = np.random.default_rng(0)
QUERY = rng.normal(size=(BATCH, LENGTH, HEADS, HEAD_DIM)).astype(np.float32)
KEY = rng.normal(size=(BATCH, LENGTH, KV_HEADS, HEAD_DIM)).astype(np.float32)
VALUE = rng.normal(size=(BATCH, LENGTH, KV_HEADS, HEAD_DIM)).astype(np.float32)
SINKS = rng.normal(size=(HEADS,)).astype(np.float32)
# Row 0 one document; row 1 three packed ones (positions restart with each).
SEGMENTS = np.array([[1] * LENGTH, [1] * 5 + [2] * 6 + [3] * 2], np.int32)
POSITIONS = np.array([list(range(LENGTH)), [*range(5), *range(6), *range(2)]], np.int32)
SELF = dict(q_segment_ids=SEGMENTS, kv_segment_ids=SEGMENTS, q_positions=POSITIONS, kv_positions=POSITIONS)


def flash(*args, **kwargs):
  return attention.KERNELS["flash"](*args, **BLOCKS, **kwargs)


def run(kernel, query, key, value, sinks, **options):
  """(output, max logits, gradients of a weighted sum of the output w.r.t. query, key, value and sinks)."""
  value_dim = (value[0] if isinstance(value, tuple) else value).shape[-1]
  out_shape = (*query.shape[:3], value_dim)
  cotangent = np.cos(np.arange(np.prod(out_shape))).reshape(out_shape).astype(np.float32)

  def loss(query, key, value, sinks):
    out, max_logits = kernel(query, key, value, sinks=sinks, return_max_logits=True, **options)
    return jnp.sum(out * cotangent), (out, max_logits)

  argnums = (0, 1, 2) if sinks is None else (0, 1, 2, 3)
  (_, (out, max_logits)), grads = jax.jit(jax.value_and_grad(loss, argnums, has_aux=True))(query, key, value, sinks)
  return out, max_logits, grads


def assert_kernels_agree(query, key, value, sinks=None, **options):
  want_out, want_max, want_grads = run(attention.dot_product_attention, query, key, value, sinks, **options)
  out, max_logits, grads = run(flash, query, key, value, sinks, **options)
  np.testing.assert_allclose(out, want_out, **TOL, err_msg="flash's output differs from dot_product's")
  np.testing.assert_allclose(max_logits, want_max, **TOL, err_msg="flash's max logits differ from dot_product's")
  for name, got, want in zip(("query", "key", "value", "sinks"), grads, want_grads):
    for i, (got_block, want_block) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)):
      np.testing.assert_allclose(
          got_block, want_block, **TOL, err_msg=f"flash's gradient w.r.t. {name} (block {i}) differs from dot_product's"
      )


def test_flash_equals_dot_product_causal_packed_grouped_query():
  assert_kernels_agree(QUERY, KEY, VALUE, **SELF)


def test_flash_equals_dot_product_with_a_sliding_window_and_sinks():
  assert_kernels_agree(QUERY, KEY, VALUE, SINKS, sliding_window_size=3, **SELF)


def test_flash_equals_dot_product_with_chunks_a_soft_cap_a_query_scale_and_keys_in_two_blocks():
  # Llama 4's chunks, Gemma 2's cap (small enough to bend the scores), and keys and values as a tuple of blocks.
  key, value = (KEY[:, :9], KEY[:, 9:]), (VALUE[:, :9], VALUE[:, 9:])
  assert_kernels_agree(QUERY, key, value, chunk_size=4, logits_soft_cap=1.5, query_scale=0.5, **SELF)


def test_flash_equals_dot_product_for_a_decode_step_against_a_cache_and_the_new_token():
  # One query per row against a cache of 10 slots and the new token, masked by the cache's own positions and
  # segments. Row 0 sees the last 3 positions of a window, so whole key blocks are masked; row 1's query is in a
  # segment no key has, so it sees nothing at all and gets dot_product's uniform average over every key.
  cache_keys = rng.normal(size=(BATCH, 10, KV_HEADS, HEAD_DIM)).astype(np.float32)
  cache_values = rng.normal(size=(BATCH, 10, KV_HEADS, HEAD_DIM)).astype(np.float32)
  key, value = (cache_keys, KEY[:, :1]), (cache_values, VALUE[:, :1])
  kv_positions = np.array([[*range(10), 10], [*range(6), 0, 0, 0, 0, 6]], np.int32)
  kv_segment_ids = np.array([[1] * 11, [1] * 6 + [0] * 4 + [1]], np.int32)
  masking = dict(
      q_segment_ids=np.array([[1], [2]], np.int32),
      kv_segment_ids=kv_segment_ids,
      q_positions=np.array([[10], [6]], np.int32),
      kv_positions=kv_positions,
  )
  assert_kernels_agree(QUERY[:, :1], key, value, sliding_window_size=3, **masking)


@pytest.fixture
def flash_calls(monkeypatch):
  """The model's flash kernel at blocks smaller than its 16 tokens (the defaults are read at each call), each
  call counted, so a model that never reached it would not pass for one that matched."""
  monkeypatch.setattr(flash_attention, "BLOCK_Q", 4)
  monkeypatch.setattr(flash_attention, "BLOCK_KV", 8)
  calls = []
  kernel = attention.KERNELS["flash"]

  def counted(*args, **kwargs):
    calls.append(args[0].shape)
    return kernel(*args, **kwargs)

  monkeypatch.setitem(attention.KERNELS, "flash", counted)
  return calls


def test_a_tiny_llama_gives_dot_products_logits_with_flash_on_linen_and_nnx(flash_calls):
  assert_flash_gives_dot_products_logits(flash_calls, "ops.attention.KERNELS['flash']")


def test_flash_refuses_context_parallelism_naming_the_key():
  # The partitioner gathers keys over "context" for dot_product; the blockwise kernel cannot, and says what to set.
  mesh = AbstractMesh((2,), ("context",))
  with sharding.active(mesh, ()), pytest.raises(ValueError, match="attention=flash .* set attention=dot_product"):
    flash(QUERY[:, :12], KEY[:, :12], VALUE[:, :12], **{k: v[:, :12] for k, v in SELF.items()})
