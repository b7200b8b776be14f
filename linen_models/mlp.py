"""Gated (SwiGLU) MLP: wo(silu(wi_0 x) * wi_1 x)."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.linears import DenseGeneral
from maxbridge.config import Config
from maxbridge.ops import mlp


class MlpBlock(nn.Module):
  config: Config
  intermediate_dim: int | None = None  # default cfg.mlp_dim (DeepSeek's shared experts differ)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype))
    hidden_dim = self.intermediate_dim or cfg.mlp_dim
    gate = DenseGeneral((cfg.emb_dim,), (hidden_dim,), ("embed", "mlp"), name="wi_0", **dtypes)(x)
    up = DenseGeneral((cfg.emb_dim,), (hidden_dim,), ("embed", "mlp"), name="wi_1", **dtypes)(x)
    hidden = mlp.silu_gate(gate, up)
    return DenseGeneral((hidden_dim,), (cfg.emb_dim,), ("mlp", "embed"), name="wo", **dtypes)(hidden)
