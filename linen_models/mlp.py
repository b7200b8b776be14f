"""Gated (SwiGLU) MLP: wo(silu(wi_0 x) * wi_1 x)."""
import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.linears import DenseGeneral
from maxbridge.config import Config
from maxbridge.ops import mlp


class MlpBlock(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype))
    gate = DenseGeneral((cfg.emb_dim,), (cfg.mlp_dim,), ("embed", "mlp"), name="wi_0", **dtypes)(x)
    up = DenseGeneral((cfg.emb_dim,), (cfg.mlp_dim,), ("embed", "mlp"), name="wi_1", **dtypes)(x)
    hidden = mlp.silu_gate(gate, up)
    return DenseGeneral((cfg.mlp_dim,), (cfg.emb_dim,), ("mlp", "embed"), name="wo", **dtypes)(hidden)
