"""Qwen3-Next ("qwen3_next"): three gated DeltaNet layers then one gated attention layer, each with a high-sparsity MoE.

A block of four layers (`SUBLAYERS`) is what the decoder stacks and scans, as
MaxText's `inhomogeneous_layer_cycle_interval: 4` does; `base_num_decoder_layers`
counts layers and must be a multiple of four. Every layer is x + mixer(norm(x)),
then x + moe(norm(x)):
- a linear-attention layer's mixer (`linear_attention`) is the gated DeltaNet of
  `maxbridge.ops.gated_deltanet`: one fused projection `in_proj_qkvz` [D, Hk,
  2K + 2gV] (per key head: its query, key, its g = Hv/Hk value heads' values and
  output gates z, Hugging Face's layout), `in_proj_ba` [D, Hk, 2g] (per key head:
  its value heads' write strengths b, then their decays a), a causal depthwise
  convolution over [q, k, v] (`conv1d/kernel` [W, C]), the decay's `A_log` and
  `dt_bias` [Hv], an RMSNorm of each value head gated by silu(z) (`norm/scale`
  [V], the multiplier itself) and `out_proj` [Hv, V, D];
- the full-attention layer's mixer (`self_attention`) is Qwen3's (per-head
  query/key RMSNorm) with an output gate: `query/kernel` [D, N, 2H] holds each
  head's query then its gate (Hugging Face's q_proj), the output is multiplied
  by sigmoid(gate) before `out`; RoPE turns the first `partial_rotary_factor`
  of each head's dims only;
- the MoE is Qwen3-MoE's routed experts (`moe_block`) plus one always-on SwiGLU
  `shared_expert` (`shared_experts` x moe_mlp_dim wide) scaled per token by
  sigmoid(`shared_expert_gate`) [D, 1].

Norms. The layer norms, the final norm and the attention's query/key norms are
zero-centred (`Family.norm` "zero_centred_rms_norm"): their `scale` holds w,
initialised at zero, and the norm multiplies by 1 + w, as Hugging Face's
Qwen3NextRMSNorm and MaxText's Qwen3NextRMSNorm (`scale_init` zeros,
`scale_offset` 1) do, so Hugging Face's weights and MaxText's checkpoints map as
they are. Unlike Gemma's tree, which holds the multiplier, weight decay then
pulls the multiplier toward 1, not 0. The DeltaNet's gated norm (Hugging Face's
Qwen3NextRMSNormGated) is not zero-centred: its `norm/scale` is the multiplier
itself, initialised at one.

Decoding keeps, per linear-attention layer, the DeltaNet state [Hv, K, V] and
the convolution's last W-1 inputs instead of a KV cache.
"""

from __future__ import annotations

from typing import Any, Mapping

from maxbridge.core.families import attention as attn
from maxbridge.core.families import qwen3_moe
from maxbridge.core.families.base import (
    RECURRENT_MIXER,
    Config,
    Family,
    Stack,
    broken,
    key_value_cache,
    routes_to_experts,
)
from maxbridge.core.families.hf_rules import (
    common_to_hf,
    CONFIG_FILE,
    ConfigClass,
    HFError,
    HFFamily,
    Linear,
    Rule,
    get_bool,
    get_float,
    get_int,
    head_dim,
    require,
    require_one_of,
    rope_from_hf,
    rope_to_hf,
)

SUBLAYERS = ("linear_0", "linear_1", "linear_2", "full")  # a block's layers, in depth order
FULL = "full"  # the one that attends in full
PATTERN = len(SUBLAYERS)
_LINEAR_KIND, _FULL_KIND = "linear_attention", "full_attention"  # Hugging Face's layer_types


def is_linear(sublayer: str) -> bool:
  return sublayer != FULL


def routes(config: Config) -> bool:
  """Whether each layer ends in routed + shared experts; otherwise in one dense MLP (Qwen3.5's dense models,
  num_experts=1 as MaxText's qwen3_5 switches)."""
  return config.num_experts > 1


# --- dimensions of a gated DeltaNet layer -------------------------------------------------------


def value_groups(config: Config) -> int:
  """Value heads per query/key head."""
  return config.gdn_num_value_heads // config.gdn_num_key_heads


def qkvz_width(config: Config) -> int:
  """Per key head, the fused projection's width: its query, key, then its value heads' values and gates."""
  return 2 * config.gdn_key_head_dim + 2 * value_groups(config) * config.gdn_value_head_dim


def conv_channels(config: Config) -> int:
  """The convolution's channels: every query, key and value feature."""
  key_dim = config.gdn_num_key_heads * config.gdn_key_head_dim
  return 2 * key_dim + config.gdn_num_value_heads * config.gdn_value_head_dim


def rotary_dim(config: Config) -> int:
  """The leading dims of each attention head that RoPE turns (Hugging Face's int(head_dim * factor))."""
  return int(config.head_dim * config.partial_rotary_factor)


# --- Hugging Face ---------------------------------------------------------------------------


class ConvKernel:
  """torch's depthwise Conv1d weight [C, 1, W] <-> our [W, C]."""

  def to_ours(self, x, shape, config):
    return x.reshape(shape[1], shape[0]).T

  def to_hf(self, x, config):
    return x.T[:, None, :]


_LINEAR = "model.layers.{layer}.linear_attn"
_MIXER = f"{{layer}}/{RECURRENT_MIXER}"
_ATTENTION = "model.layers.{layer}.self_attn"
_MOE = "model.layers.{layer}.mlp"
RULES = (
    Rule("model.embed_tokens.weight", "token_embedder/embedding"),
    Rule("model.norm.weight", "decoder/decoder_norm/scale"),
    Rule("lm_head.weight", "decoder/logits_dense/kernel", Linear()),
    Rule("model.layers.{layer}.input_layernorm.weight", "{layer}/pre_self_attention_layer_norm/scale"),
    Rule("model.layers.{layer}.post_attention_layernorm.weight", "{layer}/post_self_attention_layer_norm/scale"),
    Rule(f"{_LINEAR}.in_proj_qkvz.weight", f"{_MIXER}/in_proj_qkvz/kernel", Linear()),
    Rule(f"{_LINEAR}.in_proj_ba.weight", f"{_MIXER}/in_proj_ba/kernel", Linear()),
    Rule(f"{_LINEAR}.conv1d.weight", f"{_MIXER}/conv1d/kernel", ConvKernel()),
    Rule(f"{_LINEAR}.A_log", f"{_MIXER}/A_log"),
    Rule(f"{_LINEAR}.dt_bias", f"{_MIXER}/dt_bias"),
    Rule(f"{_LINEAR}.norm.weight", f"{_MIXER}/norm/scale"),
    Rule(f"{_LINEAR}.out_proj.weight", f"{_MIXER}/out_proj/kernel", Linear(in_ndim=2)),
    Rule(f"{_ATTENTION}.q_proj.weight", "{layer}/self_attention/query/kernel", Linear()),
    Rule(f"{_ATTENTION}.k_proj.weight", "{layer}/self_attention/key/kernel", Linear()),
    Rule(f"{_ATTENTION}.v_proj.weight", "{layer}/self_attention/value/kernel", Linear()),
    Rule(f"{_ATTENTION}.o_proj.weight", "{layer}/self_attention/out/kernel", Linear(in_ndim=2)),
    Rule(f"{_ATTENTION}.q_norm.weight", "{layer}/self_attention/query_norm/scale"),
    Rule(f"{_ATTENTION}.k_norm.weight", "{layer}/self_attention/key_norm/scale"),
    *qwen3_moe.EXPERT_RULES,
    Rule(f"{_MOE}.shared_expert.gate_proj.weight", "{layer}/shared_expert/wi_0/kernel", Linear()),
    Rule(f"{_MOE}.shared_expert.up_proj.weight", "{layer}/shared_expert/wi_1/kernel", Linear()),
    Rule(f"{_MOE}.shared_expert.down_proj.weight", "{layer}/shared_expert/wo/kernel", Linear()),
    Rule(f"{_MOE}.shared_expert_gate.weight", "{layer}/shared_expert_gate/kernel", Linear()),
)

# transformers' class defaults of what its model reads (tests compare them with transformers').
CONFIG_CLASS = ConfigClass(
    "Qwen3NextConfig",
    {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "rope_parameters": None,
        "attention_bias": False,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "decoder_sparse_step": 1,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "num_experts_per_tok": 10,
        "num_experts": 512,
        "norm_topk_prob": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "mlp_only_layers": None,
        "layer_types": None,
    },
)
# Qwen3NextConfig's partial_rotary_factor when its RoPE parameters give none.
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25


def layer_kinds(layers: int) -> list[str]:
  """Hugging Face's layer_types of `layers` layers: every fourth one full attention."""
  return [_FULL_KIND if (i + 1) % PATTERN == 0 else _LINEAR_KIND for i in range(layers)]


def _config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = CONFIG_CLASS.read(raw)
  require_one_of(hf, "hidden_act", ("silu", "swish"))
  require(hf, "attention_bias", False, False)
  qwen3_moe.every_layer_routes(hf, "qwen3_next")
  layers = get_int(hf, "num_hidden_layers")
  kinds = hf["layer_types"] or layer_kinds(layers)  # Qwen3NextConfig's default: full_attention_interval 4
  if list(kinds) != layer_kinds(layers):
    raise HFError(
        f"{CONFIG_FILE}: num_hidden_layers={layers} with layer_types={kinds!r} is not supported; maxbridge's "
        f"qwen3_next stacks blocks of {PATTERN - 1} linear_attention layers then a full_attention one"
    )
  routed = get_int(hf, "moe_intermediate_size")
  shared = get_int(hf, "shared_expert_intermediate_size")
  if shared <= 0 or shared % routed:
    raise HFError(
        f"{CONFIG_FILE}: shared_expert_intermediate_size={shared} must be a positive multiple of "
        f"moe_intermediate_size={routed} (maxbridge's shared_experts counts routed experts' widths)"
    )
  aux = get_float(hf, "router_aux_loss_coef") if get_bool(hf, "output_router_logits") else 0.0
  heads = get_int(hf, "num_attention_heads")
  return {
      "decoder_block": "qwen3_next",
      "base_emb_dim": get_int(hf, "hidden_size"),
      "base_num_query_heads": heads,
      "base_num_kv_heads": get_int(hf, "num_key_value_heads", heads),
      "head_dim": head_dim(hf, "hidden_size", "num_attention_heads"),
      # Read by no layer (every layer routes); kept so an export writes it back.
      "base_mlp_dim": get_int(hf, "intermediate_size"),
      "base_num_decoder_layers": layers,
      "vocab_size": get_int(hf, "vocab_size"),
      "normalization_layer_epsilon": get_float(hf, "rms_norm_eps"),
      **rope_from_hf(
          hf, llama3=False, default_theta=CONFIG_CLASS.default_theta, partial_rotary_default=DEFAULT_PARTIAL_ROTARY_FACTOR
      ),
      "logits_via_embedding": get_bool(hf, "tie_word_embeddings"),
      "use_qk_norm": True,
      "num_experts": get_int(hf, "num_experts"),
      "num_experts_per_tok": get_int(hf, "num_experts_per_tok"),
      "moe_mlp_dim": routed,
      "shared_experts": shared // routed,
      "routed_score_func": "softmax",
      "norm_topk_prob": get_bool(hf, "norm_topk_prob"),
      "load_balance_loss_weight": aux,
      **deltanet_from_hf(hf),
  }


def deltanet_from_hf(hf: Mapping[str, Any]) -> dict[str, Any]:
  """The Gated DeltaNet's sizes, as Qwen3-Next's and Qwen3.5's configs name them (`linear_*`)."""
  return {
      "gdn_num_key_heads": get_int(hf, "linear_num_key_heads"),
      "gdn_num_value_heads": get_int(hf, "linear_num_value_heads"),
      "gdn_key_head_dim": get_int(hf, "linear_key_head_dim"),
      "gdn_value_head_dim": get_int(hf, "linear_value_head_dim"),
      "gdn_conv_kernel_dim": get_int(hf, "linear_conv_kernel_dim"),
  }


def deltanet_to_hf(config: Config) -> dict[str, Any]:
  return {
      "linear_num_key_heads": config.gdn_num_key_heads,
      "linear_num_value_heads": config.gdn_num_value_heads,
      "linear_key_head_dim": config.gdn_key_head_dim,
      "linear_value_head_dim": config.gdn_value_head_dim,
      "linear_conv_kernel_dim": config.gdn_conv_kernel_dim,
  }


def _config_to_hf(config: Config) -> dict[str, Any]:
  qwen3_moe.check_unscaled_softmax(config, "Qwen3-Next")
  rope = rope_to_hf(config)
  rope["rope_parameters"]["partial_rotary_factor"] = config.partial_rotary_factor
  hf = {
      **common_to_hf(config),
      "layer_types": layer_kinds(config.num_decoder_layers),
      "hidden_act": "silu",
      **rope,
      "attention_bias": False,
      "num_experts": config.num_experts,
      "num_experts_per_tok": config.num_experts_per_tok,
      "moe_intermediate_size": config.moe_mlp_dim,
      "shared_expert_intermediate_size": config.shared_experts * config.moe_mlp_dim,
      # Mixtral's routing ('') is the softmax's top k renormalised.
      "norm_topk_prob": config.norm_topk_prob or config.routed_score_func == "",
      "decoder_sparse_step": 1,
      "mlp_only_layers": [],
      "output_router_logits": config.load_balance_loss_weight > 0,
      **deltanet_to_hf(config),
  }
  hf.pop("rope_theta", None)
  if config.load_balance_loss_weight > 0:  # else an imported config's coefficient is kept, and unused
    hf["router_aux_loss_coef"] = config.load_balance_loss_weight
  return hf


# --- config rules ---------------------------------------------------------------------------


def hybrid_rules(config: Config) -> list[str]:
  """What a stack of DeltaNet + gated attention blocks needs, whatever follows the mixer (also Qwen3.5's)."""
  block = config.decoder_block
  qk_norm = layers = heads = rope = clip = mtp = None
  if not config.use_qk_norm:
    qk_norm = f"decoder_block={block!r} normalises each query and key head of its attention layers: set use_qk_norm=true"
  if config.num_decoder_layers % PATTERN:
    layers = (
        f"decoder_block={block!r} stacks blocks of {PATTERN - 1} linear-attention layers then a full-attention "
        f"one: base_num_decoder_layers={config.num_decoder_layers} must be a multiple of {PATTERN}"
    )
  if config.gdn_num_value_heads % config.gdn_num_key_heads:
    heads = (
        f"gdn_num_value_heads={config.gdn_num_value_heads} must be a multiple of "
        f"gdn_num_key_heads={config.gdn_num_key_heads} (each query/key head serves a group of value heads)"
    )
  if rotary_dim(config) % 2 or not rotary_dim(config):
    rope = (
        f"partial_rotary_factor={config.partial_rotary_factor} x head_dim={config.head_dim} = {rotary_dim(config)} "
        "dims: RoPE turns pairs, so it must give a positive even number"
    )
  if config.use_qk_clip:
    clip = (
        f"use_qk_clip=true with decoder_block={block!r}: QK-Clip bounds query-key logits, which three of every "
        "four layers (gated DeltaNet: a recurrent state, no softmax logits) do not have, and the attention layers' "
        "query/key norms already bound theirs; set use_qk_clip=false"
    )
  if config.mtp_num_layers:
    mtp = (
        f"mtp_num_layers={config.mtp_num_layers} with decoder_block={block!r}: its multi-token prediction module "
        "(one gated attention layer) is not modelled, and a speculative draft could not roll a DeltaNet state back; "
        "set mtp_num_layers=0"
    )
  return broken(qk_norm, layers, heads, rope, clip, mtp)


def expert_rules(config: Config) -> list[str]:
  """The routed experts and the gated shared expert that end each layer (Qwen3-Next, Qwen3.5's MoE models)."""
  block = config.decoder_block
  shared = routing = None
  if config.shared_experts < 1:
    shared = f"decoder_block={block!r} has a gated shared expert beside the routed ones: set shared_experts >= 1"
  if config.routed_score_func not in ("", "softmax") or config.routed_bias:
    routing = (
        f"decoder_block={block!r} routes by a softmax over its experts: routed_score_func="
        f"{config.routed_score_func!r} and routed_bias={config.routed_bias} must be 'softmax' (or '') and false"
    )
  return broken(shared, routing, routes_to_experts(config))


def _check(config: Config) -> list[str]:
  return hybrid_rules(config) + expert_rules(config)


# The keys a DeltaNet hybrid reads (Qwen3.5's too), at base.yml's defaults.
OWN_KEYS = {
    "partial_rotary_factor": 1.0,
    "gdn_num_key_heads": 2,
    "gdn_num_value_heads": 4,
    "gdn_key_head_dim": 16,
    "gdn_value_head_dim": 16,
    "gdn_conv_kernel_dim": 4,
    "gdn_chunk_size": 64,
}


def deltanet_state(config: Config) -> dict[str, tuple[int, ...]]:
  """A DeltaNet layer's decode state per row: the delta rule's [Hv, K, V] and the convolution's last W-1 inputs."""
  return {
      # The names of `maxbridge.ops.kv_cache` (RECURRENT_STATE, CONV_WINDOW), which this pure-Python package cannot import.
      "recurrent_state": (config.gdn_num_value_heads, config.gdn_key_head_dim, config.gdn_value_head_dim),
      "conv_window": (config.gdn_conv_kernel_dim - 1, conv_channels(config)),
  }


def no_clip_targets(config: Config) -> dict:
  return {}  # refused by `_check`


def attention(config: Config, *, local: bool = False, kv_shared: bool = False) -> attn.AttentionSpec:
  """Qwen3's per-head query/key norms (zero-centred), partial RoPE, and an output gate projected with the query."""
  del local, kv_shared
  return attn.AttentionSpec(
      head_dim=config.head_dim,
      kv_heads=config.num_kv_heads,
      qk_norm=attn.ZERO_CENTRED_RMS_NORM,
      output_gate=True,
      rope=attn.PARTIAL_ROPE,
      rotary_dim=rotary_dim(config),
      query_scale=config.head_dim**-0.5,
  )


FAMILY = Family(
    decoder_blocks=("qwen3_next",),
    stacks=(
        Stack(
            "layers",
            "qwen3_next",
            depth=lambda config: config.num_decoder_layers // PATTERN,
            sublayers=SUBLAYERS,
            recurrent=tuple(sub for sub in SUBLAYERS if is_linear(sub)),
        ),
    ),
    attention=attention,
    norm="zero_centred_rms_norm",
    query_kernel_carries_scale=False,  # the QK-norm would undo it
    cache_entries=key_value_cache,
    qk_clip_targets=no_clip_targets,
    hf=(
        HFFamily(
            "qwen3_next", "Qwen3NextForCausalLM", ("qwen3_next",), RULES, _config_from_hf, _config_to_hf, CONFIG_CLASS
        ),
    ),
    check=_check,
    ring_cache=False,
    recurrent_state=deltanet_state,
    own_keys=OWN_KEYS,
)
