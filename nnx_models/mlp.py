"""Gated (SwiGLU) MLP: wo(silu(wi_0 x) * wi_1 x)."""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.config import Config
from maxbridge.ops import mlp
from nnx_models.linears import DenseGeneral


class MlpBlock(nnx.Module):

  def __init__(self, config: Config, intermediate_dim: int | None = None, *, rngs: nnx.Rngs):
    cfg = config
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs)
    hidden_dim = intermediate_dim or cfg.mlp_dim  # DeepSeek's shared experts differ
    self.wi_0 = DenseGeneral((cfg.emb_dim,), (hidden_dim,), ("embed", "mlp"), **dtypes)
    self.wi_1 = DenseGeneral((cfg.emb_dim,), (hidden_dim,), ("embed", "mlp"), **dtypes)
    self.wo = DenseGeneral((hidden_dim,), (cfg.emb_dim,), ("mlp", "embed"), **dtypes)

  def __call__(self, x: jax.Array) -> jax.Array:
    hidden = mlp.silu_gate(self.wi_0(x), self.wi_1(x))
    return self.wo(hidden)
