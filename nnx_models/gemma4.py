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
from maxbridge.ops import attention, mlp, normalization, proportional_rope, quantization, rotary, scaled_router
from nnx_models.attention import update_cache
from nnx_models.embeddings import Embed
from nnx_models.gemma import GeGluBlock
from nnx_models.linears import dense
from nnx_models.moe import add_expert_weight, expert_weight
from nnx_models.normalizations import RMSNorm, norm

Carry = dict
# Keys, values and the keywords that mask them (`update_cache`): what a KV-shared layer attends over.
SharedKV = tuple[jax.Array, jax.Array, dict[str, jax.Array]]


def _dtypes(cfg: Config) -> dict:
  return dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype))


def _rope(cfg: Config, local: bool, x: jax.Array, positions: jax.Array) -> jax.Array:
  if local:
    return rotary.apply_rotary(x, positions, **rotary.layer_rope(cfg, local=True))
  return proportional_rope.apply_proportional_rotary(
      x, positions, pairs=gemma4.rotary_pairs(cfg), max_timescale=cfg.rope_max_timescale
  )


class Gemma4Attention(nnx.Module):
  """Grouped-query attention; a `shared` layer has no key/value weights and attends over `shared_kv`."""

  def __init__(self, config: Config, local: bool, shared: bool, *, rngs: nnx.Rngs):
    cfg = self.config = config
    self.local, self.shared = local, shared
    heads = cfg.num_query_heads
    head_dim = self.head_dim = cfg.head_dim if local else gemma4.global_head_dim(cfg)
    kv_heads = cfg.num_kv_heads if local else gemma4.global_kv_heads(cfg)
    eps = cfg.normalization_layer_epsilon
    self.query = dense(cfg, (cfg.emb_dim,), (heads, head_dim), ("embed", "q_heads", "kv"), rngs=rngs)
    self.query_norm = RMSNorm(head_dim, eps, **_dtypes(cfg), rngs=rngs)
    if not shared:
      kv_axes = ("embed", "kv_heads", "kv_head_dim")
      self.key = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), kv_axes, rngs=rngs)
      if not (cfg.share_kv_projections and not local):
        self.value = dense(cfg, (cfg.emb_dim,), (kv_heads, head_dim), kv_axes, rngs=rngs)
      self.key_norm = RMSNorm(head_dim, eps, **_dtypes(cfg), rngs=rngs)
    self.out = dense(cfg, (heads, head_dim), (cfg.emb_dim,), ("heads", "kv", "embed"), rngs=rngs)

  def __call__(
      self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array, shared_kv: SharedKV | None
  ) -> tuple[jax.Array, SharedKV]:
    """(output, what it attended over: keys, values and the keywords that mask them, a cache's while decoding)."""
    cfg = self.config
    query = _rope(cfg, self.local, self.query_norm(self.query(x)), positions)
    kv = {}
    if self.shared:
      key, value, kv = shared_kv
    else:
      key = self.key(x)
      value = self.value(x) if hasattr(self, "value") else key  # before the key's norm and RoPE
      key = _rope(cfg, self.local, self.key_norm(key), positions)
      # The value norm has no scale.
      eps, dtype = cfg.normalization_layer_epsilon, jnp.dtype(cfg.dtype)
      value = normalization.rms_norm(value, jnp.ones((self.head_dim,)), epsilon=eps, dtype=dtype)
      (key, value), kv = update_cache(
          self, {"cached_key": key, "cached_value": value}, positions, segment_ids, ring=self.local
      )
    out, _ = attention.self_attention(
        query,
        key,
        value,
        segment_ids,
        positions,
        sliding_window_size=cfg.sliding_window_size if self.local else 0,
        query_scale=1.0,
        **kv,
    )
    return self.out(out), (key, value, kv)


class Gemma4Layer(nnx.Module):
  """One layer: carry -> carry (`Gemma4Carry`)."""

  def __init__(self, config: Config, local: bool, shared: bool, *, rngs: nnx.Rngs):
    cfg = self.config = config
    self.local, self.shared = local, shared
    self.pre_self_attention_norm = norm(cfg, rngs=rngs)
    self.self_attention = Gemma4Attention(cfg, local, shared, rngs=rngs)
    self.post_self_attention_norm = norm(cfg, rngs=rngs)
    self.pre_ffw_norm = norm(cfg, rngs=rngs)
    self.mlp = GeGluBlock(cfg, rngs=rngs)
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
    h, key_value = self.self_attention(self.pre_self_attention_norm(x), positions, segment_ids, shared_kv)
    if "kv" in carry and not self.shared:
      carry["kv"] = {**carry["kv"], kind: key_value}
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


def _param(shape: tuple[int, ...], axes: tuple, cfg: Config, rngs: nnx.Rngs) -> nnx.Param:
  return nnx.Param(initializers.placeholder(rngs.params(), shape, jnp.dtype(cfg.weight_dtype)), out_sharding=axes)


class Gemma4Router(nnx.Module):
  """The router's parameters: `kernel` [D, E], its input's `scale` [D], and `per_expert_scale` [E]."""

  def __init__(self, config: Config, *, rngs: nnx.Rngs):
    cfg = config
    self.kernel = _param((cfg.emb_dim, cfg.num_experts), ("embed", None), cfg, rngs)
    self.scale = _param((cfg.emb_dim,), ("norm",), cfg, rngs)
    self.per_expert_scale = _param((cfg.num_experts,), (None,), cfg, rngs)


class Gemma4MoE(nnx.Module):
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


class Gemma4Block(nnx.Module):
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


class Gemma4Carry(nnx.Module):
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
