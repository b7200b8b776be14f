"""Gated (SwiGLU) MLP: wo(silu(wi_0 x) * wi_1 x)."""

import flax.linen as nn
import jax

from linen_models.linears import dense
from maxbridge.core.config import Config
from maxbridge.ops import mlp


class MlpBlock(nn.Module):
  config: Config
  intermediate_dim: int | None = None  # default cfg.mlp_dim (DeepSeek's shared experts differ)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    hidden_dim = self.intermediate_dim or cfg.mlp_dim
    gate = dense(cfg, (cfg.emb_dim,), (hidden_dim,), ("embed", "mlp"), name="wi_0")(x)
    up = dense(cfg, (cfg.emb_dim,), (hidden_dim,), ("embed", "mlp"), name="wi_1")(x)
    hidden = mlp.silu_gate(gate, up)
    return dense(cfg, (hidden_dim,), (cfg.emb_dim,), ("mlp", "embed"), name="wo")(hidden)
