"""The shared math against straightforward numpy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxbridge.ops import attention, embedding, linear, losses, normalization, rotary

rng = np.random.default_rng(0)


def test_rms_norm_matches_formula():
  x = rng.normal(size=(2, 3, 8)).astype(np.float32)
  scale = rng.normal(size=(8,)).astype(np.float32)
  want = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-5) * scale
  got = normalization.rms_norm(x, scale, epsilon=1e-5, dtype=jnp.float32)
  np.testing.assert_allclose(got, want, rtol=1e-5)


def test_rotary_rotates_the_two_halves_by_position_times_frequency():
  x = rng.normal(size=(1, 4, 2, 8)).astype(np.float32)
  positions = np.array([[0, 1, 5, 2]])
  got = np.asarray(rotary.apply_rotary(x, positions, max_timescale=10_000.0))
  freq = 1.0 / 10_000.0 ** (np.arange(4) * 2 / 8)  # Llama: theta^(-2i/d)
  for t, pos in enumerate(positions[0]):
    angle = pos * freq
    first, second = x[0, t, :, :4], x[0, t, :, 4:]
    want = np.concatenate(
        [first * np.cos(angle) - second * np.sin(angle), second * np.cos(angle) + first * np.sin(angle)],
        axis=-1,
    )
    np.testing.assert_allclose(got[0, t], want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(got[0, 0], x[0, 0])  # position 0 is the identity


def test_rotary_rejects_bad_shapes():
  with pytest.raises(ValueError, match=r"x \[B, T, N, H\] and positions \[B, T\]"):
    rotary.apply_rotary(jnp.zeros((2, 3, 8)), jnp.zeros((2, 3)), max_timescale=1e4)


def naive_attention(q, k, v, segment_ids):
  batch, length, heads, _ = q.shape
  group = heads // k.shape[2]
  out = np.zeros_like(q)
  for b in range(batch):
    for h in range(heads):
      kv = h // group  # query head j reads kv head j // (N / K)
      for t in range(length):
        allowed = [s for s in range(t + 1) if segment_ids[b, s] == segment_ids[b, t]]
        scores = np.array([q[b, t, h] @ k[b, s, kv] for s in allowed])
        weights = np.exp(scores - scores.max())
        weights /= weights.sum()
        out[b, t, h] = sum(w * v[b, s, kv] for w, s in zip(weights, allowed))
  return out


def test_grouped_query_attention_with_segments_matches_naive_loop():
  q = rng.normal(size=(2, 6, 4, 8)).astype(np.float32)
  k = rng.normal(size=(2, 6, 2, 8)).astype(np.float32)
  v = rng.normal(size=(2, 6, 2, 8)).astype(np.float32)
  segment_ids = np.array([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 0]])
  positions = np.broadcast_to(np.arange(6), (2, 6))  # the loop's causality is by index
  mask = dict(q_segment_ids=segment_ids, kv_segment_ids=segment_ids, q_positions=positions, kv_positions=positions)
  got = attention.dot_product_attention(q, k, v, **mask)
  np.testing.assert_allclose(got, naive_attention(q, k, v, segment_ids), rtol=1e-5, atol=1e-5)


# Two packed documents then padding; positions restart with each document.
PACKED_SEGMENTS = np.array([[1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1]])
PACKED_POSITIONS = np.array([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 0], list(range(12))])


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("rows", [slice(9, 12), slice(4, 7), slice(11, 12)], ids=["last3", "middle", "last"])
def test_masks_from_distinct_query_and_key_positions_are_the_full_mask_sliced(rows, window):
  seg, pos = PACKED_SEGMENTS, PACKED_POSITIONS
  full = np.asarray(attention.attention_mask(seg, seg, pos, pos, window))
  sliced = np.asarray(attention.attention_mask(seg[:, rows], seg, pos[:, rows], pos, window))
  assert sliced.shape == (2, 1, 1, rows.stop - rows.start, 12)
  np.testing.assert_array_equal(sliced, full[..., rows, :])
  # Keys not yet seen (a cache filled up to the query block) leave the visible ones unchanged.
  prefix = np.asarray(
      attention.attention_mask(seg[:, rows], seg[:, : rows.stop], pos[:, rows], pos[:, : rows.stop], window)
  )
  np.testing.assert_array_equal(prefix, full[..., rows, : rows.stop])


def test_attention_of_a_query_block_against_all_keys_is_full_attention_sliced():
  q = rng.normal(size=(2, 12, 4, 8)).astype(np.float32)
  k = rng.normal(size=(2, 12, 2, 8)).astype(np.float32)
  v = rng.normal(size=(2, 12, 2, 8)).astype(np.float32)
  seg, pos = PACKED_SEGMENTS, PACKED_POSITIONS
  full = attention.dot_product_attention(
      q, k, v, q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos, sliding_window_size=4
  )
  rows = slice(8, 12)
  block = attention.dot_product_attention(
      q[:, rows],
      k,
      v,
      q_segment_ids=seg[:, rows],
      kv_segment_ids=seg,
      q_positions=pos[:, rows],
      kv_positions=pos,
      sliding_window_size=4,
  )
  np.testing.assert_allclose(block, np.asarray(full)[:, rows], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("row", [0, 4, 10, 11])
def test_one_query_row_a_decode_step_is_full_attention_sliced(row):
  # What a decode step runs: one query per row against every cached key.
  q = rng.normal(size=(2, 12, 4, 8)).astype(np.float32)
  k = rng.normal(size=(2, 12, 2, 8)).astype(np.float32)
  v = rng.normal(size=(2, 12, 2, 8)).astype(np.float32)
  seg, pos = PACKED_SEGMENTS, PACKED_POSITIONS
  keys = dict(kv_segment_ids=seg, kv_positions=pos, sliding_window_size=4, query_scale=0.5)
  full = attention.dot_product_attention(q, k, v, q_segment_ids=seg, q_positions=pos, **keys)
  one, max_logits = attention.dot_product_attention(
      q[:, row : row + 1],
      k,
      v,
      q_segment_ids=seg[:, row : row + 1],
      q_positions=pos[:, row : row + 1],
      return_max_logits=True,
      **keys,
  )
  assert one.shape == (2, 1, 4, 8)
  np.testing.assert_allclose(one, np.asarray(full)[:, row : row + 1], rtol=1e-6, atol=1e-6)
  mask = np.asarray(attention.attention_mask(seg[:, row : row + 1], seg, pos[:, row : row + 1], pos, 4))[:, 0, 0, 0]
  scores = np.einsum("bnh,bsnh->bns", 0.5 * q[:, row], np.repeat(k, 2, axis=2))  # query head j reads kv head j // 2
  want = np.where(mask[:, None], scores, -np.inf).max(axis=(0, 2))
  np.testing.assert_allclose(max_logits, want, rtol=1e-6)


def test_attention_mask_names_mismatched_shapes():
  seg = np.ones((2, 5), np.int32)
  with pytest.raises(ValueError, match=r"segment ids and positions differ in shape: queries \(2, 5\) vs \(2, 4\)"):
    attention.attention_mask(seg, seg, seg[:, :4], seg)
  with pytest.raises(ValueError, match=r"q_positions \(2, 5\) and kv_positions \(1, 5\) must be"):
    attention.attention_mask(seg, seg, seg, seg[:1])


def test_max_logits_are_each_heads_largest_visible_score():
  q = rng.normal(size=(2, 6, 4, 8)).astype(np.float32)
  k = rng.normal(size=(2, 6, 2, 8)).astype(np.float32)
  v = rng.normal(size=(2, 6, 2, 8)).astype(np.float32)
  seg = np.array([[1, 1, 1, 2, 2, 2], [1, 1, 1, 1, 1, 0]])
  pos = np.array([[0, 1, 2, 0, 1, 2], [0, 1, 2, 3, 4, 0]])
  mask = dict(q_segment_ids=seg, kv_segment_ids=seg, q_positions=pos, kv_positions=pos)
  out, max_logits = attention.dot_product_attention(q, k, v, query_scale=0.5, return_max_logits=True, **mask)
  np.testing.assert_array_equal(out, attention.dot_product_attention(q, k, v, query_scale=0.5, **mask))
  want = np.full(4, -np.inf)
  for b in range(2):
    for h in range(4):
      for t in range(6):
        for s in range(6):
          if seg[b, s] == seg[b, t] and pos[b, s] <= pos[b, t]:
            want[h] = max(want[h], 0.5 * q[b, t, h] @ k[b, s, h // 2])
  assert max_logits.shape == (4,) and max_logits.dtype == jnp.float32
  np.testing.assert_allclose(max_logits, want, rtol=1e-5)
  # Masked pairs score higher for some head here, so ignoring the mask would show.
  all_scores = 0.5 * np.einsum("BTKGH,BSKH->BKGTS", q.reshape(2, 6, 2, 2, 8), k)
  assert np.any(all_scores.max(axis=(0, 3, 4)).reshape(4) > want)
  grad = jax.grad(lambda q: attention.dot_product_attention(q, k, v, return_max_logits=True, **mask)[1].sum())(q)
  assert not np.any(grad)


class CountingDotGeneral:
  """jax.lax.dot_general that records the shape of each right-hand operand (the weight)."""

  def __init__(self):
    self.weights = []

  def __call__(self, lhs, rhs, dimension_numbers, **kwargs):
    self.weights.append(tuple(rhs.shape))
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, **kwargs)


def test_dense_general_goes_through_the_given_dot_general_in_its_dtype():
  x = rng.normal(size=(2, 3, 4, 5)).astype(np.float32)
  kernel = rng.normal(size=(4, 5, 6, 7)).astype(np.float32)
  bias = rng.normal(size=(6, 7)).astype(np.float32)
  counting = CountingDotGeneral()
  got = linear.dense_general(x, kernel, in_ndim=2, dtype=jnp.float32, bias=bias, dot_general=counting)
  assert counting.weights == [(4, 5, 6, 7)]
  np.testing.assert_allclose(got, np.tensordot(x, kernel, axes=2) + bias, rtol=1e-5, atol=1e-5)
  half = linear.dense_general(x, kernel, in_ndim=2, dtype=jnp.bfloat16, bias=bias)
  assert half.dtype == jnp.bfloat16
  with pytest.raises(ValueError, match=r"input trailing shape \(4, 5\) does not match kernel leading shape \(5, 4\)"):
    linear.dense_general(x, kernel.reshape(5, 4, 6, 7), in_ndim=2, dtype=jnp.float32)


def test_cross_entropy_and_z_loss_match_formula():
  logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
  targets = rng.integers(0, 5, size=(2, 3))
  lse = np.log(np.sum(np.exp(logits), axis=-1))
  target_logit = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  loss, z = losses.cross_entropy_with_z_loss(logits, targets, z_loss_multiplier=1e-2)
  np.testing.assert_allclose(z, 1e-2 * lse**2, rtol=1e-5)
  np.testing.assert_allclose(loss, lse - target_logit + 1e-2 * lse**2, rtol=1e-5)


def test_embed_rejects_float_tokens_and_attend_is_the_transpose():
  table = rng.normal(size=(10, 4)).astype(np.float32)
  with pytest.raises(TypeError, match="tokens must be integers"):
    embedding.embed(jnp.zeros((1, 2)), table, dtype=jnp.float32)
  x = rng.normal(size=(1, 2, 4)).astype(np.float32)
  counting = CountingDotGeneral()
  np.testing.assert_allclose(embedding.attend(x, table, dtype=jnp.float32, dot_general=counting), x @ table.T, rtol=1e-5)
  assert counting.weights == [(10, 4)]
