"""Linen and NNX, in all 8 flag combinations, agree with pure Linen on llama-tiny."""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxbridge as mb
from maxbridge.core import canonical
from maxbridge.ops import losses
from conftest import FLAG_COMBINATIONS, flag_id, tiny_config

TOL = 1e-6


def loss_fn(model: mb.Model, tokens):
  """params -> (loss, logits), logits over the full sequence."""

  def loss(params):
    logits = model.apply(params, tokens)
    per_token, _ = losses.cross_entropy_with_z_loss(logits[:, :-1], tokens[:, 1:], z_loss_multiplier=1e-4)
    return jnp.mean(per_token), logits

  return loss


def logits_and_grads(model: mb.Model, tokens):
  (_, logits), grads = jax.jit(jax.value_and_grad(loss_fn(model, tokens), has_aux=True))(model.params())
  return logits, grads


@functools.lru_cache(maxsize=None)
def reference(scan_layers: bool, remat_policy: str):
  """Pure Linen: params, logits, grads and logical axes, computed once per setting."""
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
  model = mb.create_model(tiny_config(scan_layers=scan_layers, remat_policy=remat_policy), seed=0)
  logits, grads = logits_and_grads(model, tokens)
  return model, logits, grads


def assert_trees_close(got, want, tol, what):
  # Flat paths as keys: chex then names a differing leaf by its canonical path.
  got, want = canonical.flatten(got), canonical.flatten(want)
  chex.assert_trees_all_equal_shapes(got, want, custom_message=what)
  chex.assert_trees_all_close(got, want, atol=tol, rtol=0, custom_message=what)


@pytest.mark.parametrize("remat_policy", ["none", "full"])
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unscanned"])
@pytest.mark.parametrize("flags", FLAG_COMBINATIONS, ids=map(flag_id, FLAG_COMBINATIONS))
def test_every_flag_combination_matches_pure_linen(flags, scan_layers, remat_policy, tokens):
  ref_model, ref_logits, ref_grads = reference(scan_layers, remat_policy)
  model = mb.create_model(tiny_config(flags, scan_layers=scan_layers, remat_policy=remat_policy), seed=0)

  # Same canonical tree: names, shapes, dtypes and logical axes.
  assert model.abstract_params() == ref_model.abstract_params()
  assert canonical.flatten(model.logical_axes()) == canonical.flatten(ref_model.logical_axes())
  # Same initial parameters for the same seed, bit for bit.
  assert_trees_close(model.params(), ref_model.params(), 0.0, "initial params")
  # Same logits and gradients on the same weights.
  logits, grads = logits_and_grads(model, tokens)
  assert logits.dtype == jnp.float32 and logits.shape == (2, 16, 256)
  np.testing.assert_allclose(logits, ref_logits, atol=TOL, rtol=0)
  assert_trees_close(grads, ref_grads, TOL, "grads")


@pytest.mark.parametrize("flags", [(False, False, False), (True, True, True)], ids=["linen", "nnx"])
def test_scanned_parameters_are_the_unscanned_layers_stacked(flags, tokens):
  scanned = mb.create_model(tiny_config(flags, scan_layers=True), seed=3)
  unscanned = mb.create_model(tiny_config(flags, scan_layers=False), seed=3)
  axis = scanned.config.param_scan_axis
  assert_trees_close(canonical.stack_layers(unscanned.params(), axis), scanned.params(), 0.0, "params")
  np.testing.assert_allclose(scanned.logits(tokens), unscanned.logits(tokens), atol=TOL, rtol=0)


def test_scanned_layers_carry_the_layers_axis_at_param_scan_axis():
  for axis in (0, 1):
    for flags in FLAG_COMBINATIONS:
      model = mb.create_model(tiny_config(flags, param_scan_axis=axis), seed=0)
      axes = canonical.flatten(model.logical_axes())
      shapes = canonical.flatten(model.abstract_params())
      query = "decoder/layers/self_attention/query/kernel"
      assert axes[query][axis] == "layers", (flag_id(flags), axes[query])
      assert shapes[query].shape[axis] == model.config.num_decoder_layers
      assert axes["token_embedder/embedding"] == ("vocab", "embed")


def test_minimal_remat_and_tied_embeddings_match_across_backends(tokens):
  linen = mb.create_model(tiny_config(remat_policy="minimal", logits_via_embedding=True))
  for flags in FLAG_COMBINATIONS[1:]:
    model = mb.create_model(tiny_config(flags, remat_policy="minimal", logits_via_embedding=True))
    assert "logits_dense" not in model.params()["decoder"]
    np.testing.assert_allclose(model.logits(tokens), linen.logits(tokens), atol=TOL, rtol=0)


@pytest.mark.parametrize("flags", [(False, False, False), (True, True, True)], ids=["linen", "nnx"])
@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unscanned"])
def test_remat_policy_reaches_the_compiled_gradient(flags, scan_layers, tokens):
  def jaxpr(policy):
    model = mb.create_model(tiny_config(flags, scan_layers=scan_layers, remat_policy=policy))
    return str(jax.make_jaxpr(jax.grad(loss_fn(model, tokens), has_aux=True))(model.params()))

  assert "checkpoint" not in jaxpr("none") and "remat" not in jaxpr("none")
  assert "checkpoint" in jaxpr("full") or "remat" in jaxpr("full")


def test_different_seeds_give_different_parameters():
  a = mb.create_model(tiny_config(), seed=0).params()
  b = mb.create_model(tiny_config(), seed=1).params()
  assert not np.allclose(a["token_embedder"]["embedding"], b["token_embedder"]["embedding"])
