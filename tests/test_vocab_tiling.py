"""Vocabulary tiling: the custom-vjp tiled loss equals the untiled one, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxbridge import vocab_tiling
from maxbridge.config import ConfigError
from maxbridge.ops import losses

B, T, D, V = 4, 8, 16, 64


@pytest.fixture(scope="module")
def problem():
  keys = jax.random.split(jax.random.key(0), 5)
  hidden = jax.random.normal(keys[0], (B, T, D))
  trainable = {"kernel": jax.random.normal(keys[1], (D, V)) * 0.3}
  frozen = {"scale": jax.random.normal(keys[2], (D,))}
  targets = jax.random.randint(keys[3], (B, T), 0, V)
  weights = (jax.random.uniform(keys[4], (B, T)) > 0.3).astype(jnp.float32)  # padded positions
  return trainable, frozen, hidden, targets, weights


def _head(trainable, frozen, hidden):
  return (hidden * frozen["scale"]) @ trainable["kernel"]


@pytest.mark.parametrize("num_tiles", [2, 4, 8])
def test_tiled_loss_and_gradients_match_untiled(problem, num_tiles):
  trainable, frozen, hidden, targets, weights = problem

  def untiled(p, x):
    per_token, z = losses.cross_entropy_with_z_loss(_head(p, frozen, x), targets, z_loss_multiplier=1e-2)
    return jnp.sum(per_token * weights) + 3 * jnp.sum(z * weights)

  def tiled(p, x):
    total, z = vocab_tiling.tiled_cross_entropy(
        _head, p, frozen, x, targets, weights, num_tiles=num_tiles, z_loss_multiplier=1e-2
    )
    return total + 3 * z

  want, want_grads = jax.value_and_grad(untiled, argnums=(0, 1))(trainable, hidden)
  got, got_grads = jax.jit(jax.value_and_grad(tiled, argnums=(0, 1)))(trainable, hidden)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(w))))


def test_tiling_that_does_not_divide_the_rows_names_the_key_and_valid_values(problem):
  trainable, frozen, hidden, targets, weights = problem
  with pytest.raises(ConfigError, match=r"num_vocab_tiling=5 .* 32 rows .*valid values: \[1, 2, 4, 8, 16, 32\]"):
    vocab_tiling.tiled_cross_entropy(_head, trainable, frozen, hidden, targets, weights, num_tiles=5)
