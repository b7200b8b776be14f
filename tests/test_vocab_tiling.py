"""Vocabulary tiling: the custom-vjp tiled loss equals the untiled one, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxbridge as mb
from conftest import FLAG_COMBINATIONS, flag_id, tiny_config
from maxbridge.core import canonical
from maxbridge.training import data, vocab_tiling
from maxbridge.core.config import ConfigError
from maxbridge.ops import losses
from maxbridge.training import recipe

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
    return 3 * jnp.sum(per_token * weights), jnp.sum(z * weights)

  def tiled(p, x):
    total, z = vocab_tiling.tiled_cross_entropy(
        _head, p, frozen, x, targets, weights, num_tiles=num_tiles, z_loss_multiplier=1e-2
    )
    return 3 * total, z

  (want, want_z), want_grads = jax.value_and_grad(untiled, argnums=(0, 1), has_aux=True)(trainable, hidden)
  (got, got_z), got_grads = jax.jit(jax.value_and_grad(tiled, argnums=(0, 1), has_aux=True))(trainable, hidden)
  np.testing.assert_allclose(got, want, rtol=1e-6)
  np.testing.assert_allclose(got_z, want_z, rtol=1e-6)
  # Undifferentiated (evaluation) runs the plain scan: the same sums.
  np.testing.assert_allclose(jax.jit(tiled)(trainable, hidden)[0], want, rtol=1e-6)
  for g, w in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6 * float(jnp.max(jnp.abs(w))))


def test_tiling_that_does_not_divide_the_rows_names_the_key_and_valid_values(problem):
  trainable, frozen, hidden, targets, weights = problem
  with pytest.raises(ConfigError, match=r"num_vocab_tiling=5 .* 32 rows .*valid values: \[1, 2, 4, 8, 16, 32\]"):
    vocab_tiling.tiled_cross_entropy(_head, trainable, frozen, hidden, targets, weights, num_tiles=5)


# --- through the model and the train step ----------------------------------


def _grads(config, batch):
  """(loss sum, canonical gradients) of the configured training loss at the seed-0 initial state."""
  trainer = recipe.create_trainer(config)
  state = trainer.init_state(0)

  @jax.jit
  def value_and_grad(state, batch):
    bound = trainer._bind(state)
    (loss, _), grads = jax.value_and_grad(lambda p: trainer._loss(bound, p, batch), has_aux=True)(bound.params)
    return loss, grads

  return value_and_grad(state, trainer.loss_batch(batch))


def _batch(config, rows=4):
  # The embedded data packs several documents per row: padded and segmented positions included.
  return {k: jnp.asarray(v) for k, v in data.make_dataset(config, "train", rows).batch(0).items()}


def _assert_grads_close(got, want, rtol):
  for path, value in canonical.flatten(want).items():
    scale = float(jnp.max(jnp.abs(value))) or 1.0
    np.testing.assert_allclose(canonical.flatten(got)[path], value, rtol=rtol, atol=rtol * scale, err_msg=path)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_model_loss_and_every_gradient_match_untiled_and_linen_matches_nnx(tied):
  overrides = dict(z_loss_multiplier=1e-3, logits_via_embedding=tied)
  batch = _batch(tiny_config(**overrides))
  want_loss, want = _grads(tiny_config(**overrides), batch)
  tiled = {}
  for name, flags in (("linen", (False, False, False)), ("nnx", (True, True, True))):
    loss, grads = _grads(tiny_config(flags, num_vocab_tiling=4, **overrides), batch)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5, err_msg=name)
    _assert_grads_close(grads, want, rtol=1e-5)
    tiled[name] = (loss, grads)
  np.testing.assert_allclose(tiled["nnx"][0], tiled["linen"][0], rtol=1e-6)
  _assert_grads_close(tiled["nnx"][1], tiled["linen"][1], rtol=1e-6)


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS, ids=flag_id)
def test_every_flag_combination_trains_tiled_with_the_untiled_numbers(flags, tiled_reference):
  config = tiny_config(flags, num_vocab_tiling=2, gradient_accumulation_steps=2)
  trainer = recipe.create_trainer(config)
  state, metrics = trainer.train_step(trainer.init_state(0), tiled_reference["batch"])
  np.testing.assert_allclose(metrics["loss"], tiled_reference["loss"], rtol=1e-5)
  np.testing.assert_allclose(metrics["grad_norm"], tiled_reference["grad_norm"], rtol=1e-5)
  _assert_grads_close(trainer.params(state), tiled_reference["params"], rtol=1e-5)


@pytest.fixture(scope="module")
def tiled_reference():
  """One untiled pure-Linen step with two micro-batches (gradient accumulation)."""
  config = tiny_config(gradient_accumulation_steps=2)
  trainer = recipe.create_trainer(config)
  batch = _batch(config)
  state, metrics = trainer.train_step(trainer.init_state(0), batch)
  return {"batch": batch, "loss": metrics["loss"], "grad_norm": metrics["grad_norm"], "params": trainer.params(state)}


def test_bfloat16_tiled_run_trains(tmp_path):
  config = tiny_config(
      (True, True, True),
      num_vocab_tiling=4,
      dtype="bfloat16",
      weight_dtype="bfloat16",
      steps=6,
      learning_rate=1e-2,
      eval_interval=0,
      enable_checkpointing=False,
      base_output_directory=str(tmp_path),
  )
  losses_seen = [record["loss"] for record in mb.train(config, progress=False)]
  assert all(np.isfinite(losses_seen)), losses_seen
  assert losses_seen[-1] < losses_seen[0], losses_seen
