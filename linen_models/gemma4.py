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

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.attention import Attention
from linen_models.embeddings import Embed
from linen_models.gemma import GeGluBlock
from linen_models.linears import dense
from linen_models.moe import expert_weight
from linen_models.normalizations import RMSNorm, norm
from maxbridge.core import initializers
from maxbridge.core.config import Config
from maxbridge.core.families import gemma4
from maxbridge.ops import attention, mlp, quantization, scaled_router

Carry = dict


def _dtypes(config: Config) -> dict:
  return dict(dtype=jnp.dtype(config.dtype), weight_dtype=jnp.dtype(config.weight_dtype))


class Gemma4Layer(nn.Module):
  """One layer: carry -> carry (`Gemma4Carry`)."""

  config: Config
  local: bool
  shared: bool

  @nn.compact
  def __call__(self, carry: Carry, positions: jax.Array, segment_ids: jax.Array) -> Carry:
    cfg = self.config
    carry = dict(carry)
    kind = gemma4.LOCAL if self.local else gemma4.GLOBAL
    x = carry["x"]
    h = norm(cfg, name="pre_self_attention_norm")(x)
    shared_kv = carry["kv"][kind] if self.shared else None
    h, values = Attention(cfg, self.local, self.shared, name="self_attention")(h, positions, segment_ids, shared_kv)
    if "kv" in carry and not self.shared:
      carry["kv"] = {**carry["kv"], kind: values[attention.ATTENDED]}
    x = x + norm(cfg, name="post_self_attention_norm")(h)
    h = GeGluBlock(cfg, gemma4.mlp_dim(cfg, self.shared), name="mlp")(norm(cfg, name="pre_ffw_norm")(x))
    if cfg.num_experts > 1:  # the MoE variant: experts beside the MLP, routed by the same input
      routed = Gemma4MoE(cfg, name="moe_block")(norm(cfg, name="pre_ffw_norm_2")(x), x)
      h = norm(cfg, name="post_ffw_norm_1")(h) + norm(cfg, name="post_ffw_norm_2")(routed)
    x = x + norm(cfg, name="post_ffw_norm")(h)
    if cfg.hidden_size_per_layer_input:
      width = cfg.hidden_size_per_layer_input
      own = jax.lax.dynamic_index_in_dim(carry["per_layer"], carry["layer"], axis=2, keepdims=False)
      h = dense(cfg, (cfg.emb_dim,), (width,), ("embed", "mlp"), name="per_layer_input_gate")(x)
      h = dense(cfg, (width,), (cfg.emb_dim,), ("mlp", "embed"), name="per_layer_projection")(mlp.gelu_gate(h, own))
      x = x + norm(cfg, name="post_per_layer_input_norm")(h)
    scalar = self.param(
        "layer_scalar", nn.with_logical_partitioning(initializers.placeholder, (None,)), (1,), jnp.dtype(cfg.weight_dtype)
    )
    carry["x"] = x * scalar.astype(x.dtype)
    carry["layer"] = carry["layer"] + 1
    return carry


class Gemma4Router(nn.Module):
  """The router's parameters: `kernel` [D, E], its input's `scale` [D], and `per_expert_scale` [E]."""

  config: Config

  @nn.compact
  def __call__(self) -> tuple[jax.Array, jax.Array, jax.Array]:
    cfg = self.config
    dtype = jnp.dtype(cfg.weight_dtype)

    def param(name, shape, axes):
      return self.param(name, nn.with_logical_partitioning(initializers.placeholder, axes), shape, dtype)

    kernel = param("kernel", (cfg.emb_dim, cfg.num_experts), ("embed", None))
    return param("scale", (cfg.emb_dim,), ("norm",)), kernel, param("per_expert_scale", (cfg.num_experts,), (None,))


class Gemma4MoE(nn.Module):
  """Routed GeGLU experts (`ops.scaled_router`): bare [E, in, out] `wi_0`, `wi_1`, `wo` beside the `gate`."""

  config: Config

  @nn.compact
  def __call__(self, x: jax.Array, router_input: jax.Array) -> jax.Array:
    cfg = self.config
    experts, width, hidden = cfg.num_experts, cfg.emb_dim, cfg.moe_mlp_dim
    wi_0 = expert_weight(self, cfg, "wi_0", (experts, width, hidden), ("exp", "embed_no_exp", "mlp"))
    wi_1 = expert_weight(self, cfg, "wi_1", (experts, width, hidden), ("exp", "embed_no_exp", "mlp"))
    wo = expert_weight(self, cfg, "wo", (experts, hidden, width), ("exp", "mlp", "embed_no_exp"))
    scale, kernel, per_expert_scale = Gemma4Router(cfg, name="gate")()
    return scaled_router.scaled_router_moe(
        x,
        router_input,
        scale,
        kernel,
        per_expert_scale,
        wi_0,
        wi_1,
        wo,
        k=cfg.num_experts_per_tok,
        epsilon=cfg.normalization_layer_epsilon,
        sparse=cfg.sparse_matmul,
        dtype=jnp.dtype(cfg.dtype),
        dot_general=quantization.expert_dot_general(cfg, quantization.linen_dot_general(cfg)),
        ragged_dot=quantization.ragged_dot(cfg),
    )


class Gemma4Block(nn.Module):
  """Five sliding-window layers then a global one (`gemma4.SUBLAYERS`): the unit the decoder stacks."""

  config: Config
  shared: bool = False

  @nn.compact
  def __call__(self, carry: Carry, positions: jax.Array, segment_ids: jax.Array) -> tuple[Carry, dict]:
    for name in gemma4.SUBLAYERS:
      carry = Gemma4Layer(self.config, name != gemma4.GLOBAL, self.shared, name=name)(carry, positions, segment_ids)
    return carry, {}


class Gemma4KVSharedBlock(Gemma4Block):
  """A block of the last layers (`kv_shared_layers`): no key/value weights, the carry's keys and values."""

  shared: bool = True


class Gemma4Carry(nn.Module):
  """Embedded tokens (and the tokens) -> the carry the layers pass on: {x, layer, per_layer?, kv?}.

  per_layer [B, T, layers, width]: (norm(projection(x) / sqrt(emb_dim)) + the
  tokens' rows of the per-layer table) / sqrt(2), as transformers' Gemma 4.
  kv: zero keys/values of each kind, which the layers before the KV-shared ones fill.
  """

  config: Config

  @nn.compact
  def __call__(self, x: jax.Array, tokens: jax.Array | None) -> Carry:
    cfg = self.config
    carry = {"x": x, "layer": jnp.zeros((), jnp.int32)}
    if cfg.hidden_size_per_layer_input:
      if tokens is None:
        raise ValueError("decoder_block='gemma4' with hidden_size_per_layer_input > 0 needs the tokens: pass tokens")
      layers, width = cfg.num_decoder_layers, cfg.hidden_size_per_layer_input
      table = Embed(cfg.vocab_size, layers * width, name="per_layer_token_embedder", **_dtypes(cfg))
      projection = dense(cfg, (cfg.emb_dim,), (layers, width), ("embed", None, "mlp"), name="per_layer_model_projection")
      projected = projection(x) * cfg.emb_dim**-0.5
      projected = RMSNorm(width, cfg.normalization_layer_epsilon, name="per_layer_projection_norm", **_dtypes(cfg))(
          projected
      )
      own = table(tokens).reshape(*tokens.shape, layers, width)
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
