"""Gemma 1's, 2's and 3's decoder layers (the canonical trees' layouts: `maxbridge.core.families.gemma`, `gemma3`).

Gemma 1 is Llama's layer with a GeGLU MLP, by MaxText's names (`pre_self_attention_norm`,
`pre_ffw_norm`). A Gemma 2 layer normalises each branch's input and output
(`pre_/post_self_attention_norm`, `pre_/post_ffw_norm`) and soft-caps its attention
logits; a stacked Gemma 2 layer is a block of a sliding-window layer and a global
one, as MaxText scans them, its modules named as MaxText's Gemma2DecoderLayer
names them (`self_attention_local`, `mlp_global`). A Gemma 3 layer is Gemma 2's with
per-head query/key norms and its kind's own RoPE; its stacked block is five
sliding-window layers then a global one, and the layers past the last whole
block stack on their own (`Gemma3LocalLayer`).
"""

import flax.linen as nn
import jax

from linen_models.attention import Attention
from linen_models.linears import dense
from linen_models.normalizations import norm
from maxbridge.core.config import Config
from maxbridge.core.families import gemma, gemma3
from maxbridge.ops import mlp


class GeGluBlock(nn.Module):
  """wo(gelu_tanh(wi_0 x) * wi_1 x)."""

  config: Config
  intermediate_dim: int | None = None  # default cfg.mlp_dim (Gemma 4's double-wide KV-shared layers differ)

  @nn.compact
  def __call__(self, x: jax.Array) -> jax.Array:
    cfg = self.config
    width = self.intermediate_dim or cfg.mlp_dim
    gate = dense(cfg, (cfg.emb_dim,), (width,), ("embed", "mlp"), name="wi_0")(x)
    up = dense(cfg, (cfg.emb_dim,), (width,), ("embed", "mlp"), name="wi_1")(x)
    return dense(cfg, (width,), (cfg.emb_dim,), ("mlp", "embed"), name="wo")(mlp.gelu_gate(gate, up))


class GemmaDecoderLayer(nn.Module):
  """Gemma 1: x + attention(norm(x)), then x + mlp(norm(x)) (MaxText's names; (1 + w) held in the norm scales)."""

  config: Config

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    cfg = self.config
    h = norm(cfg, name="pre_self_attention_norm")(x)
    h, per_layer = Attention(cfg, name="self_attention")(h, positions, segment_ids)
    x = x + h
    return x + GeGluBlock(cfg, name="mlp")(norm(cfg, name="pre_ffw_norm")(x)), per_layer


def _gemma2_sublayer(
    config: Config, local: bool, suffix: str, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """x + norm(attention(norm(x))), then x + norm(mlp(norm(x))), its modules named `<name><suffix>`.

  Called inside a compact method: the modules belong to the caller, so a block's
  two sub-layers can share one scope with MaxText's suffixed names.
  """
  h = norm(config, name=f"pre_self_attention_norm{suffix}")(x)
  h, per_layer = Attention(config, local, name=f"self_attention{suffix}")(h, positions, segment_ids)
  x = x + norm(config, name=f"post_self_attention_norm{suffix}")(h)
  h = GeGluBlock(config, name=f"mlp{suffix}")(norm(config, name=f"pre_ffw_norm{suffix}")(x))
  return x + norm(config, name=f"post_ffw_norm{suffix}")(h), per_layer


class Gemma2Layer(nn.Module):
  """One Gemma 2 style layer (Gemma 3's; `local`: windowed), with unsuffixed names."""

  config: Config
  local: bool = False

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    return _gemma2_sublayer(self.config, self.local, "", x, positions, segment_ids)


class Gemma2Block(nn.Module):
  """A sliding-window layer then a global one: the unit the decoder stacks (`Stack.sublayers`).

  MaxText's Gemma2DecoderLayer: one scope, each module's name suffixed by its
  sub-layer (`self_attention_local`, `mlp_global`).
  """

  config: Config

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    for sub in gemma.GEMMA2_SUBLAYERS:
      x, _ = _gemma2_sublayer(self.config, sub == gemma.LOCAL, f"_{sub}", x, positions, segment_ids)
    return x, {}


class Gemma3Block(nn.Module):
  """Five sliding-window layers then a global one (`gemma3.SUBLAYERS`): the unit the decoder stacks."""

  config: Config

  @nn.compact
  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    for name in gemma3.SUBLAYERS:
      x, _ = Gemma2Layer(self.config, name != gemma3.GLOBAL, name=name)(x, positions, segment_ids)
    return x, {}


class Gemma3LocalLayer(Gemma2Layer):
  """A sliding-window layer: those past Gemma 3's last whole block, stacked on their own (`layers_remainder`)."""

  local: bool = True
