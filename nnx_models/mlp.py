"""Gated (SwiGLU) MLP: wo(silu(wi_0 x) * wi_1 x)."""

import jax
from flax import nnx

from maxbridge.core.config import Config
from maxbridge.ops import mlp
from nnx_models import Module
from nnx_models.linears import dense


class MlpBlock(Module):

  def __init__(self, config: Config, intermediate_dim: int | None = None, *, rngs: nnx.Rngs):
    cfg = config
    hidden_dim = intermediate_dim or cfg.mlp_dim  # DeepSeek's shared experts differ
    self.wi_0 = dense(cfg, (cfg.emb_dim,), (hidden_dim,), ("embed", "mlp"), rngs=rngs)
    self.wi_1 = dense(cfg, (cfg.emb_dim,), (hidden_dim,), ("embed", "mlp"), rngs=rngs)
    self.wo = dense(cfg, (hidden_dim,), (cfg.emb_dim,), ("mlp", "embed"), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    hidden = mlp.silu_gate(self.wi_0(x), self.wi_1(x))
    return self.wo(hidden)
