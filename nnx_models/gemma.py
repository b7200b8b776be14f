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

import jax
from flax import nnx

from maxbridge.core.config import Config
from maxbridge.core.families import gemma, gemma3
from maxbridge.ops import mlp
from nnx_models import Module
from nnx_models.attention import Attention
from nnx_models.linears import dense
from nnx_models.normalizations import norm


class GeGluBlock(Module):
  """wo(gelu_tanh(wi_0 x) * wi_1 x)."""

  def __init__(self, config: Config, intermediate_dim: int | None = None, *, rngs: nnx.Rngs):
    cfg = config
    width = intermediate_dim or cfg.mlp_dim  # default cfg.mlp_dim (Gemma 4's double-wide KV-shared layers differ)
    self.wi_0 = dense(cfg, (cfg.emb_dim,), (width,), ("embed", "mlp"), rngs=rngs)
    self.wi_1 = dense(cfg, (cfg.emb_dim,), (width,), ("embed", "mlp"), rngs=rngs)
    self.wo = dense(cfg, (width,), (cfg.emb_dim,), ("mlp", "embed"), rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    return self.wo(mlp.gelu_gate(self.wi_0(x), self.wi_1(x)))


class GemmaDecoderLayer(Module):
  """Gemma 1: x + attention(norm(x)), then x + mlp(norm(x)) (MaxText's names; (1 + w) held in the norm scales)."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    self.pre_self_attention_norm = norm(config, rngs=rngs)
    self.self_attention = Attention(config, rngs=rngs)
    self.pre_ffw_norm = norm(config, rngs=rngs)
    self.mlp = GeGluBlock(config, rngs=rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    h, per_layer = self.self_attention(self.pre_self_attention_norm(x), positions, segment_ids)
    x = x + h
    return x + self.mlp(self.pre_ffw_norm(x)), per_layer


_MODULES = (
    "pre_self_attention_norm",
    "self_attention",
    "post_self_attention_norm",
    "pre_ffw_norm",
    "mlp",
    "post_ffw_norm",
)


def _gemma2_modules(config: Config, local: bool, rngs: nnx.Rngs) -> dict[str, nnx.Module]:
  """One Gemma 2 style layer's modules, by their unsuffixed names (`_MODULES`)."""
  return {
      "pre_self_attention_norm": norm(config, rngs=rngs),
      "self_attention": Attention(config, local, rngs=rngs),
      "post_self_attention_norm": norm(config, rngs=rngs),
      "pre_ffw_norm": norm(config, rngs=rngs),
      "mlp": GeGluBlock(config, rngs=rngs),
      "post_ffw_norm": norm(config, rngs=rngs),
  }


def _gemma2_sublayer(
    owner: nnx.Module, suffix: str, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """x + norm(attention(norm(x))), then x + norm(mlp(norm(x))), with `owner`'s modules `<name><suffix>`."""
  m = {name: getattr(owner, name + suffix) for name in _MODULES}
  h, per_layer = m["self_attention"](m["pre_self_attention_norm"](x), positions, segment_ids)
  x = x + m["post_self_attention_norm"](h)
  h = m["mlp"](m["pre_ffw_norm"](x))
  return x + m["post_ffw_norm"](h), per_layer


class Gemma2Layer(Module):
  """One Gemma 2 style layer (Gemma 3's; `local`: windowed), with unsuffixed names."""

  def __init__(self, config: Config, local: bool = False, *, rngs: nnx.Rngs):
    for name, module in _gemma2_modules(config, local, rngs).items():
      setattr(self, name, module)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    return _gemma2_sublayer(self, "", x, positions, segment_ids)


class Gemma2Block(Module):
  """A sliding-window layer then a global one: the unit the decoder stacks (`Stack.sublayers`).

  MaxText's Gemma2DecoderLayer: one module whose attribute names end in their
  sub-layer (`self_attention_local`, `mlp_global`).
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    for sub in gemma.GEMMA2_SUBLAYERS:
      for name, module in _gemma2_modules(config, sub == gemma.LOCAL, rngs).items():
        setattr(self, f"{name}_{sub}", module)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    for sub in gemma.GEMMA2_SUBLAYERS:
      x, _ = _gemma2_sublayer(self, f"_{sub}", x, positions, segment_ids)
    return x, {}


class Gemma3Block(Module):
  """Five sliding-window layers then a global one (`gemma3.SUBLAYERS`): the unit the decoder stacks."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    for name in gemma3.SUBLAYERS:  # set by name: `global` is a Python keyword
      setattr(self, name, Gemma2Layer(config, name != gemma3.GLOBAL, rngs=rngs))

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    for name in gemma3.SUBLAYERS:
      x, _ = getattr(self, name)(x, positions, segment_ids)
    return x, {}


class Gemma3LocalLayer(Gemma2Layer):
  """A sliding-window layer: those past Gemma 3's last whole block, stacked on their own (`layers_remainder`)."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    super().__init__(config, True, rngs=rngs)
