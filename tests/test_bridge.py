"""The three flax.nnx.bridge pitfalls that maxbridge.bridge handles, each shown failing in flax."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx import bridge as flax_bridge

from maxbridge.core import bridge


class Layer(nnx.Module):
  """An NNX layer with one logically partitioned kernel, scan-shaped (carry, out)."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (3, 3)) * 0.1, out_sharding=("embed", "mlp"))

  def __call__(self, x, _):
    return jnp.tanh(x @ self.w[...]), None


def scanned_stack(to_linen):
  class Stack(nn.Module):

    @nn.compact
    def __call__(self, x):
      scan = nn.scan(
          to_linen,
          variable_axes={"params": 1},
          split_rngs={"params": True},
          in_axes=(nn.broadcast,),
          length=2,
          metadata_params={nn.PARTITION_NAME: "layers"},
      )
      return scan(Layer, name="layers")(x, None)[0]

  return Stack()


@pytest.mark.parametrize("wrapper", [flax_bridge.ToNNX, bridge.ToNNX], ids=["flax", "maxbridge"])
def test_to_nnx_supports_raw_grad_over_split_state(wrapper):
  x = jnp.ones((2, 3))
  model = wrapper(nn.Dense(4), rngs=nnx.Rngs(0)).lazy_init(x)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  loss = lambda p: jnp.sum(nnx.merge(graphdef, p, rest)(x) ** 2)
  if wrapper is flax_bridge.ToNNX:
    with pytest.raises(Exception, match="Cannot mutate RngCount from a different trace level"):
      jax.grad(loss)(params)
    return
  grads = jax.grad(loss)(params)
  kernel = params["kernel"][...]
  y = x @ kernel + params["bias"][...]
  np.testing.assert_allclose(grads["kernel"][...], x.T @ (2 * y), rtol=1e-6)


@pytest.mark.parametrize("wrapper", [flax_bridge.ToLinen, bridge.ToLinen], ids=["flax", "maxbridge"])
def test_scanned_to_linen_keeps_the_layers_axis_name(wrapper):
  variables = jax.eval_shape(scanned_stack(wrapper).init, jax.random.key(0), jnp.ones((2, 3)))
  spec = nn.get_partition_spec(variables["params"])["layers"]["w"]
  assert variables["params"]["layers"]["w"].value.shape == (3, 2, 3)
  if wrapper is flax_bridge.ToLinen:
    assert tuple(spec) == ("embed", "mlp")  # flax's NNXMeta.add_axis is a no-op
  else:
    assert tuple(spec) == ("embed", "layers", "mlp")


def test_scanned_to_linen_applies_each_layer_with_its_own_weights():
  x = jnp.ones((2, 3))
  stack = scanned_stack(bridge.ToLinen)
  params = nn.unbox(stack.init(jax.random.key(0), x))["params"]
  w = params["layers"]["w"]
  want = jnp.tanh(jnp.tanh(x @ w[:, 0]) @ w[:, 1])
  np.testing.assert_allclose(stack.apply({"params": params}, x), want, rtol=1e-6)


@pytest.mark.parametrize("wrapper", [flax_bridge.ToLinen, bridge.ToLinen], ids=["flax", "maxbridge"])
def test_to_linen_refuses_missing_parameters(wrapper):
  x = jnp.ones((2, 3))
  stack = scanned_stack(wrapper)
  params = nn.unbox(stack.init(jax.random.key(0), x))["params"]
  del params["layers"]["w"]
  if wrapper is flax_bridge.ToLinen:
    stack.apply({"params": params}, x)  # flax re-initialises "w" and runs
    return
  with pytest.raises(ValueError, match=r"(?s)at 'layers'.*missing: w \(3, 3\)"):
    stack.apply({"params": params}, x)


def test_to_linen_refuses_unknown_parameters():
  x = jnp.ones((2, 3))
  stack = scanned_stack(bridge.ToLinen)
  params = nn.unbox(stack.init(jax.random.key(0), x))["params"]
  params["layers"]["typo"] = jnp.zeros((3, 2))  # scanned leaves need the layer axis
  with pytest.raises(ValueError, match="unknown: typo"):
    stack.apply({"params": params}, x)


def test_to_linen_is_jittable_and_differentiable():
  x = jnp.ones((2, 3))
  stack = scanned_stack(bridge.ToLinen)
  params = nn.unbox(stack.init(jax.random.key(0), x))["params"]
  loss = lambda p: jnp.sum(stack.apply({"params": p}, x))
  grads = jax.jit(jax.grad(loss))(params)
  eps = 1e-3
  bumped = jax.tree.map(lambda w: w.at[0, 1, 2].add(eps), params)
  numeric = (loss(bumped) - loss(params)) / eps
  np.testing.assert_allclose(grads["layers"]["w"][0, 1, 2], numeric, rtol=2e-2)
