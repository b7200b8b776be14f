"""What a layer returns and what it writes survive scan and remat, the same on both backends.

A test-only Llama layer counts its calls and sums its MLP's input into cache
variables, and returns that sum as a per-layer value; the decoder must keep
both, scanned or not, rematerialised or not, in Linen and in NNX.
"""

import functools
import itertools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxbridge as mb
from linen_models import decoders as linen_decoders
from linen_models import llama as linen_llama
from maxbridge.core import canonical, initializers
from maxbridge.models.model import flat_intermediates
from nnx_models import decoders as nnx_decoders
from nnx_models import llama as nnx_llama
from conftest import tiny_config

CALLS = 2
X = jax.random.normal(jax.random.key(3), (2, 8, 64))
POSITIONS = jnp.broadcast_to(jnp.arange(8), (2, 8))
SEGMENT_IDS = jnp.ones((2, 8), jnp.int32)


class LinenCountingLayer(linen_llama.DecoderLayer):

  def feed_forward(self, h):
    calls = self.variable("cache", "calls", jnp.zeros, (), jnp.int32)
    input_sum = self.variable("cache", "mlp_input_sum", jnp.zeros, (), jnp.float32)
    if not self.is_initializing():
      calls.value += 1
      input_sum.value += jnp.sum(h)
    out, per_layer = super().feed_forward(h)
    return out, {**per_layer, "mlp_input_sum": jnp.sum(h)}


class NNXCountingLayer(nnx_llama.DecoderLayer):

  def init_feed_forward(self, config, rngs):
    super().init_feed_forward(config, rngs)
    self.calls = nnx.Cache(jnp.zeros((), jnp.int32))
    self.mlp_input_sum = nnx.Cache(jnp.zeros((), jnp.float32))

  def feed_forward(self, h):
    self.calls[...] += 1
    self.mlp_input_sum[...] += jnp.sum(h)
    out, per_layer = super().feed_forward(h)
    return out, {**per_layer, "mlp_input_sum": jnp.sum(h)}


def decoder_params(config):
  abstract = jax.eval_shape(linen_decoders.Decoder(config).init, jax.random.key(0), X, POSITIONS, SEGMENT_IDS)
  return initializers.init_params(nn.unbox(abstract["params"]), 0, initializers.InitOptions.from_config(config))


def run_linen(config, params):
  """(logits, cache, flat intermediates) after CALLS calls."""
  decoder = linen_decoders.Decoder(config)
  cache = decoder.init(jax.random.key(0), X, POSITIONS, SEGMENT_IDS)["cache"]
  apply = jax.jit(functools.partial(decoder.apply, mutable=["cache", "intermediates"]))
  for _ in range(CALLS):
    logits, variables = apply({"params": params, "cache": cache}, X, POSITIONS, SEGMENT_IDS)
    cache = variables["cache"]
  return logits, cache, flat_intermediates(variables["intermediates"])


def run_nnx(config, params):
  decoder = nnx_decoders.Decoder(config, rngs=nnx.Rngs(0))
  nnx.update(decoder, params)
  call = nnx.jit(lambda decoder: decoder(X, POSITIONS, SEGMENT_IDS))
  for _ in range(CALLS):
    logits = call(decoder)
    intermediates = nnx.pop(decoder, nnx.Intermediate)
  cache = nnx.to_pure_dict(nnx.state(decoder, nnx.Cache))
  return logits, cache, flat_intermediates(nnx.to_pure_dict(intermediates))


RUNS = {"linen": (run_linen, LinenCountingLayer), "nnx": (run_nnx, NNXCountingLayer)}


@pytest.fixture(scope="module")
def results():
  """(backend, scan_layers, remat_policy) -> (logits, cache stacked on axis 0, intermediates)."""
  out = {}
  with pytest.MonkeyPatch.context() as patch:
    for backend, scan, remat in itertools.product(RUNS, [True, False], ["none", "full"]):
      run, layer = RUNS[backend]
      module = linen_decoders if backend == "linen" else nnx_decoders
      patch.setattr(module, "layer_classes", lambda config, layer=layer: {"layers": layer})
      config = tiny_config(scan_layers=scan, remat_policy=remat)
      logits, cache, intermediates = run(config, decoder_params(config))
      cache = cache if scan else canonical.stack_layers(cache, axis=0)
      out[backend, scan, remat] = logits, canonical.flatten(cache), intermediates
  return out


def test_layer_state_is_written_once_per_call_scanned_or_not_with_or_without_remat(results):
  layers = tiny_config().num_decoder_layers
  want_logits, want_cache, want_intermediates = results["linen", False, "none"]
  assert sorted(want_cache) == ["layers/calls", "layers/mlp_input_sum"]
  np.testing.assert_array_equal(want_cache["layers/calls"], np.full(layers, CALLS))
  # Each call adds the same input sum, the value the layer also returns.
  np.testing.assert_allclose(want_cache["layers/mlp_input_sum"], CALLS * want_intermediates["mlp_input_sum"])
  for setting, (logits, cache, _) in results.items():
    np.testing.assert_allclose(logits, want_logits, atol=1e-5, err_msg=str(setting))
    assert sorted(cache) == sorted(want_cache), setting
    np.testing.assert_array_equal(cache["layers/calls"], want_cache["layers/calls"], err_msg=str(setting))
    np.testing.assert_allclose(
        cache["layers/mlp_input_sum"], want_cache["layers/mlp_input_sum"], rtol=1e-5, err_msg=str(setting)
    )


def test_per_layer_values_are_sown_stacked_on_the_layer_axis(results):
  layers = tiny_config().num_decoder_layers
  want = results["linen", False, "none"][2]["mlp_input_sum"]
  assert want.shape == (layers,) and np.all(want != 0)
  for setting, (_, _, intermediates) in results.items():
    # The decoder is the root here; inside a model these are decoder/hidden_states, decoder/mlp_input_sum.
    assert sorted(intermediates) == ["hidden_states", "mlp_input_sum"], setting
    np.testing.assert_allclose(intermediates["mlp_input_sum"], want, rtol=1e-5, err_msg=str(setting))


@pytest.mark.parametrize("scan_layers", [True, False])
def test_moe_losses_are_sown_per_layer_and_their_mean_is_the_training_term(scan_layers):
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
  sown = {}
  for backend, flags in {"linen": (False, False, False), "nnx": (True, True, True)}.items():
    config = mb.load_config(
        "mixtral-tiny", scan_layers=scan_layers, pure_nnx=flags[0], enable_nnx=flags[1], pure_nnx_decoder=flags[2]
    )
    model = mb.create_model(config, seed=0)
    _, intermediates = model.apply_with_intermediates(model.params(), tokens)
    per_layer = intermediates["decoder/moe_lb_losses"]
    assert per_layer.shape == (config.num_decoder_layers,), backend
    assert float(intermediates["decoder/moe_lb_loss"]) == float(jnp.mean(per_layer)), backend
    sown[backend] = per_layer
  np.testing.assert_array_equal(sown["nnx"], sown["linen"])
