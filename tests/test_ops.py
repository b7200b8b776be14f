"""The shared math against straightforward numpy references."""

import jax.numpy as jnp
import numpy as np
import pytest

from maxbridge.ops import attention, embedding, losses, normalization, rotary

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
  got = attention.dot_product_attention(q, k, v, segment_ids)
  np.testing.assert_allclose(got, naive_attention(q, k, v, segment_ids), rtol=1e-5, atol=1e-5)


def test_cross_entropy_and_z_loss_match_formula():
  logits = rng.normal(size=(2, 3, 5)).astype(np.float32)
  targets = rng.integers(0, 5, size=(2, 3))
  lse = np.log(np.sum(np.exp(logits), axis=-1))
  target_logit = np.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
  loss, z = losses.cross_entropy_with_z_loss(logits, targets, z_loss_multiplier=1e-2)
  np.testing.assert_allclose(z, 1e-2 * lse**2, rtol=1e-5)
  np.testing.assert_allclose(loss, lse - target_logit + 1e-2 * lse**2, rtol=1e-5)


def test_masked_mean_ignores_masked_positions():
  values = jnp.array([[1.0, 2.0, 100.0]])
  assert float(losses.masked_mean(values, jnp.array([[1, 1, 0]]))) == 1.5
  assert float(losses.masked_mean(values, jnp.zeros((1, 3)))) == 0.0


def test_embed_rejects_float_tokens_and_attend_is_the_transpose():
  table = rng.normal(size=(10, 4)).astype(np.float32)
  with pytest.raises(TypeError, match="tokens must be integers"):
    embedding.embed(jnp.zeros((1, 2)), table, dtype=jnp.float32)
  x = rng.normal(size=(1, 2, 4)).astype(np.float32)
  np.testing.assert_allclose(embedding.attend(x, table, dtype=jnp.float32), x @ table.T, rtol=1e-5)
