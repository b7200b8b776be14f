"""Gemma 4's decoder layers (the canonical tree's layout: `maxbridge.core.families.gemma4`).

A layer is Gemma 3's (pre- and post-norms around attention and the MLP, QK-norm)
with an RMSNorm without a scale on the values, attention scaled by 1, its own
input gated in (`per_layer_input_gate`, `per_layer_projection`) and its output
times `layer_scalar`. Global layers have their own head width and key/value
heads and turn by proportional RoPE. The layers pass a carry (`Gemma4Carry`):
the hidden states, the index of the next layer (which picks its per-layer
input), and the keys/values the KV-shared layers read, which each earlier layer
of a kind overwrites.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.core.families import gemma4
from maxbridge.ops import attention, mlp, quantization, scaled_router
from nnx_models import Module
from nnx_models.attention import Attention
from nnx_models.embeddings import Embed
from nnx_models.gemma import GeGluBlock
from nnx_models.linears import dense
from nnx_models.moe import add_expert_weight, expert_weight
from nnx_models.normalizations import RMSNorm, norm

Carry = dict


def _dtypes(config: Config) -> dict:
  return dict(dtype=jnp.dtype(config.dtype), weight_dtype=jnp.dtype(config.weight_dtype))


class Gemma4Layer(Module):
  """One layer: carry -> carry (`Gemma4Carry`)."""

  def __init__(self, config: Config, local: bool, shared: bool, *, rngs: nnx.Rngs):
    cfg = self.config = config
    self.local, self.shared = local, shared
    self.pre_self_attention_norm = norm(cfg, rngs=rngs)
    self.self_attention = Attention(cfg, local, shared, rngs=rngs)
    self.post_self_attention_norm = norm(cfg, rngs=rngs)
    self.pre_ffw_norm = norm(cfg, rngs=rngs)
    self.mlp = GeGluBlock(cfg, gemma4.mlp_dim(cfg, shared), rngs=rngs)
    self.post_ffw_norm = norm(cfg, rngs=rngs)
    if cfg.num_experts > 1:  # the MoE variant: experts beside the MLP, routed by the same input
      self.moe_block = Gemma4MoE(cfg, rngs=rngs)
      self.pre_ffw_norm_2 = norm(cfg, rngs=rngs)
      self.post_ffw_norm_1 = norm(cfg, rngs=rngs)
      self.post_ffw_norm_2 = norm(cfg, rngs=rngs)
    if cfg.hidden_size_per_layer_input:
      width = cfg.hidden_size_per_layer_input
      self.per_layer_input_gate = dense(cfg, (cfg.emb_dim,), (width,), ("embed", "mlp"), rngs=rngs)
      self.per_layer_projection = dense(cfg, (width,), (cfg.emb_dim,), ("mlp", "embed"), rngs=rngs)
      self.post_per_layer_input_norm = norm(cfg, rngs=rngs)
    self.layer_scalar = nnx.Param(
        initializers.placeholder(rngs.params(), (1,), jnp.dtype(cfg.weight_dtype)), out_sharding=(None,)
    )

  def __call__(self, carry: Carry, positions: jax.Array, segment_ids: jax.Array) -> Carry:
    cfg = self.config
    carry = dict(carry)
    kind = gemma4.LOCAL if self.local else gemma4.GLOBAL
    x = carry["x"]
    shared_kv = carry["kv"][kind] if self.shared else None
    h, values = self.self_attention(self.pre_self_attention_norm(x), positions, segment_ids, shared_kv)
    if "kv" in carry and not self.shared:
      carry["kv"] = {**carry["kv"], kind: values[attention.ATTENDED]}
    x = x + self.post_self_attention_norm(h)
    h = self.mlp(self.pre_ffw_norm(x))
    if cfg.num_experts > 1:
      h = self.post_ffw_norm_1(h) + self.post_ffw_norm_2(self.moe_block(self.pre_ffw_norm_2(x), x))
    x = x + self.post_ffw_norm(h)
    if cfg.hidden_size_per_layer_input:
      own = jax.lax.dynamic_index_in_dim(carry["per_layer"], carry["layer"], axis=2, keepdims=False)
      h = self.per_layer_projection(mlp.gelu_gate(self.per_layer_input_gate(x), own))
      x = x + self.post_per_layer_input_norm(h)
    carry["x"] = x * self.layer_scalar[...].astype(x.dtype)
    carry["layer"] = carry["layer"] + 1
    return carry


def _param(shape: tuple[int, ...], axes: tuple, config: Config, rngs: nnx.Rngs) -> nnx.Param:
  return nnx.Param(initializers.placeholder(rngs.params(), shape, jnp.dtype(config.weight_dtype)), out_sharding=axes)


class Gemma4Router(Module):
  """The router's parameters: `kernel` [D, E], its input's `scale` [D], and `per_expert_scale` [E]."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = config
    self.kernel = _param((cfg.emb_dim, cfg.num_experts), ("embed", None), cfg, rngs)
    self.scale = _param((cfg.emb_dim,), ("norm",), cfg, rngs)
    self.per_expert_scale = _param((cfg.num_experts,), (None,), cfg, rngs)


class Gemma4MoE(Module):
  """Routed GeGLU experts (`ops.scaled_router`): bare [E, in, out] `wi_0`, `wi_1`, `wo` beside the `gate`."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = self.config = config
    experts, width, hidden = cfg.num_experts, cfg.emb_dim, cfg.moe_mlp_dim
    add_expert_weight(self, cfg, "wi_0", (experts, width, hidden), ("exp", "embed_no_exp", "mlp"), rngs)
    add_expert_weight(self, cfg, "wi_1", (experts, width, hidden), ("exp", "embed_no_exp", "mlp"), rngs)
    add_expert_weight(self, cfg, "wo", (experts, hidden, width), ("exp", "mlp", "embed_no_exp"), rngs)
    self.gate = Gemma4Router(cfg, rngs=rngs)

  def __call__(self, x: jax.Array, router_input: jax.Array) -> jax.Array:
    cfg, gate = self.config, self.gate
    return scaled_router.scaled_router_moe(
        x,
        router_input,
        gate.scale[...],
        gate.kernel[...],
        gate.per_expert_scale[...],
        *(expert_weight(self, cfg, name) for name in ("wi_0", "wi_1", "wo")),
        k=cfg.num_experts_per_tok,
        epsilon=cfg.normalization_layer_epsilon,
        sparse=cfg.sparse_matmul,
        dtype=jnp.dtype(cfg.dtype),
        dot_general=quantization.expert_dot_general(cfg, quantization.nnx_dot_general(cfg)),
        ragged_dot=quantization.ragged_dot(cfg),
    )


class Gemma4Block(Module):
  """Five sliding-window layers then a global one (`gemma4.SUBLAYERS`): the unit the decoder stacks."""

  shared = False

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    for name in gemma4.SUBLAYERS:  # set by name: `global` is a Python keyword
      setattr(self, name, Gemma4Layer(config, name != gemma4.GLOBAL, self.shared, rngs=rngs))

  def __call__(self, carry: Carry, positions: jax.Array, segment_ids: jax.Array) -> tuple[Carry, dict]:
    for name in gemma4.SUBLAYERS:
      carry = getattr(self, name)(carry, positions, segment_ids)
    return carry, {}


class Gemma4KVSharedBlock(Gemma4Block):
  """A block of the last layers (`kv_shared_layers`): no key/value weights, the carry's keys and values."""

  shared = True


class Gemma4Carry(Module):
  """Embedded tokens (and the tokens) -> the carry the layers pass on: {x, layer, per_layer?, kv?}.

  per_layer [B, T, layers, width]: (norm(projection(x) / sqrt(emb_dim)) + the
  tokens' rows of the per-layer table) / sqrt(2), as transformers' Gemma 4.
  kv: zero keys/values of each kind, which the layers before the KV-shared ones fill.
  """

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = self.config = config
    if cfg.hidden_size_per_layer_input:
      layers, width = cfg.num_decoder_layers, cfg.hidden_size_per_layer_input
      dtypes = _dtypes(cfg)
      self.per_layer_token_embedder = Embed(cfg.vocab_size, layers * width, **dtypes, rngs=rngs)
      self.per_layer_model_projection = dense(cfg, (cfg.emb_dim,), (layers, width), ("embed", None, "mlp"), rngs=rngs)
      self.per_layer_projection_norm = RMSNorm(width, cfg.normalization_layer_epsilon, **dtypes, rngs=rngs)

  def __call__(self, x: jax.Array, tokens: jax.Array | None) -> Carry:
    cfg = self.config
    carry = {"x": x, "layer": jnp.zeros((), jnp.int32)}
    if cfg.hidden_size_per_layer_input:
      if tokens is None:
        raise ValueError("decoder_block='gemma4' with hidden_size_per_layer_input > 0 needs the tokens: pass tokens")
      layers, width = cfg.num_decoder_layers, cfg.hidden_size_per_layer_input
      projected = self.per_layer_projection_norm(self.per_layer_model_projection(x) * cfg.emb_dim**-0.5)
      own = self.per_layer_token_embedder(tokens).reshape(*tokens.shape, layers, width)
      carry["per_layer"] = (projected + own) * 2**-0.5
    if cfg.num_kv_shared_layers:
      batch, length = x.shape[:2]
      local = (batch, length, cfg.num_kv_heads, cfg.head_dim)
      wide = (batch, length, gemma4.global_kv_heads(cfg), gemma4.global_head_dim(cfg))
      # Decoding runs the layers unrolled, so a layer may give these a cache's length, and the masks' keywords.
      carry["kv"] = {
          gemma4.LOCAL: (jnp.zeros(local, x.dtype), jnp.zeros(local, x.dtype), {}),
          gemma4.GLOBAL: (jnp.zeros(wide, x.dtype), jnp.zeros(wide, x.dtype), {}),
      }
    return carry
