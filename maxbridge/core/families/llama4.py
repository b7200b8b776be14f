"""Llama 4 ("llama4", text only): chunked RoPE attention, NoPE layers, MoE layers interleaved with dense ones.

Every `nope_layer_interval`-th layer (4, as in every Llama 4) has no RoPE, attends
in full and, with `temperature_tuning`, sharpens its queries with their position
(`ops.attention.temperature_tuning`); the others rotate queries and keys (Hugging
Face's interleaved pairs, `apply_rotary(interleave=True)`; Llama 3.1's scaling),
normalise them without a learned scale (`use_qk_norm`: Hugging Face's
Llama4TextL2Norm) and attend within chunks of `chunk_attn_window_size` positions.
Every `interleave_moe_layer_step`-th layer is MoE: a sigmoid top-k router whose
score scales each chosen expert's input (`ops.moe`, score_func 'topk_sigmoid')
plus an always-on shared expert; the others have a dense SwiGLU MLP of `mlp_dim`.

As MaxText's Llama4ScannableBlock, the decoder stacks blocks of four layers
(`SUBLAYERS`: three RoPE layers, then the NoPE one) and scans them;
`base_num_decoder_layers` counts layers. The MoE block is MaxText's
(`Llama4MoEBlock_0`: routed `MoeBlock_0` with `gate`, `wi_0`, `wi_1`, `wo`, and
`shared_experts`); Hugging Face's fused `gate_up_proj` [E, D, 2F] is split into
`wi_0` and `wi_1` on import and joined on export (`Part`). While decoding, a
chunked layer keeps a ring of one chunk (`Stack.rings`: all its queries may
see, masked by position to their own chunk), the NoPE layers every token.
"""

from __future__ import annotations

from typing import Any, Mapping

from maxbridge.core.families import attention as attn
from maxbridge.core.families import llama
from maxbridge.core.families.base import Config, Family, Stack, broken, key_value_cache, query_kernel_clip, routes_to_experts
from maxbridge.core.families.hf_rules import (
    CONFIG_FILE,
    ConfigClass,
    HFError,
    HFFamily,
    Linear,
    Part,
    Rule,
    get,
    get_bool,
    get_float,
    get_int,
    require,
)

SUBLAYERS = ("rope_0", "rope_1", "rope_2", "nope")  # a block's layers, in depth order
PATTERN = len(SUBLAYERS)  # the one nope_layer_interval supported
MOE_STEPS = (1, 2, 4)  # interleave_moe_layer_step values that repeat within a block


def uses_rope(sublayer: int) -> bool:
  """Whether a block's `sublayer`-th layer rotates (and chunks); the last one is NoPE."""
  return sublayer != PATTERN - 1


def is_moe(config: Config, sublayer: int) -> bool:
  """Whether a block's `sublayer`-th layer is MoE: Hugging Face's moe_layers, every step-th layer from step - 1."""
  return (sublayer + 1) % config.interleave_moe_layer_step == 0


_ATTENTION = "model.layers.{layer}.self_attn"
_FF = "model.layers.{layer}.feed_forward"
_MOE = "{layer}/Llama4MoEBlock_0"
RULES = (
    *llama.COMMON_RULES,
    # No query scale in the kernel: the QK-norm would undo it (attention scales at run time).
    Rule(f"{_ATTENTION}.q_proj.weight", "{layer}/self_attention/query/kernel", Linear()),
    Rule(f"{_ATTENTION}.k_proj.weight", "{layer}/self_attention/key/kernel", Linear()),
    Rule(f"{_ATTENTION}.v_proj.weight", "{layer}/self_attention/value/kernel", Linear()),
    Rule(f"{_ATTENTION}.o_proj.weight", "{layer}/self_attention/out/kernel", Linear(in_ndim=2)),
    # Dense layers.
    Rule(f"{_FF}.gate_proj.weight", "{layer}/mlp/wi_0/kernel", Linear()),
    Rule(f"{_FF}.up_proj.weight", "{layer}/mlp/wi_1/kernel", Linear()),
    Rule(f"{_FF}.down_proj.weight", "{layer}/mlp/wo/kernel", Linear()),
    # MoE layers: experts stacked and laid out [in, out] on both sides; the fused gate/up tensor holds
    # MaxText's wi_0 then wi_1 (its llama4_ckpt_unscanned splits it the same way).
    Rule(f"{_FF}.router.weight", f"{_MOE}/MoeBlock_0/gate/kernel", Linear()),
    Rule(f"{_FF}.experts.gate_up_proj", f"{_MOE}/MoeBlock_0/wi_0", Part(0, 2)),
    Rule(f"{_FF}.experts.gate_up_proj", f"{_MOE}/MoeBlock_0/wi_1", Part(1, 2)),
    Rule(f"{_FF}.experts.down_proj", f"{_MOE}/MoeBlock_0/wo"),
    Rule(f"{_FF}.shared_expert.gate_proj.weight", f"{_MOE}/shared_experts/wi_0/kernel", Linear()),
    Rule(f"{_FF}.shared_expert.up_proj.weight", f"{_MOE}/shared_experts/wi_1/kernel", Linear()),
    Rule(f"{_FF}.shared_expert.down_proj.weight", f"{_MOE}/shared_experts/wo/kernel", Linear()),
)

# transformers' Llama4TextConfig defaults of what its model reads (tests compare them with transformers').
CONFIG_CLASS = ConfigClass(
    "Llama4TextConfig",
    {
        "vocab_size": 202048,
        "hidden_size": 5120,
        "intermediate_size": 8192,
        "intermediate_size_mlp": 16384,
        "num_hidden_layers": 48,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "hidden_act": "silu",
        "max_position_embeddings": 4096 * 32,
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "num_experts_per_tok": 1,
        "num_local_experts": 16,
        "moe_layers": None,
        "interleave_moe_layer_step": 1,
        "use_qk_norm": True,
        "output_router_logits": False,
        "router_aux_loss_coef": 0.001,
        "router_jitter_noise": 0.0,
        "rope_parameters": None,
        "no_rope_layers": None,
        "no_rope_layer_interval": 4,
        "attention_chunk_size": 8192,
        "layer_types": None,
        "attn_temperature_tuning": True,
        "floor_scale": 8192,
        "attn_scale": 0.1,
        "attention_bias": False,
    },
    default_theta=500000.0,
)


def _layers_as_blocks(hf: Mapping[str, Any], layers: int) -> int:
  """interleave_moe_layer_step, after checking that the layers repeat as maxbridge's blocks."""
  if layers % PATTERN:
    raise HFError(
        f"{CONFIG_FILE}: num_hidden_layers={layers} must be a multiple of {PATTERN} (maxbridge's llama4 blocks)"
    )
  interval = get_int(hf, "no_rope_layer_interval")
  nope = [int((i + 1) % interval != 0) for i in range(layers)]
  given = hf["no_rope_layers"] or nope  # Llama4TextConfig's __post_init__: an empty list is the default too
  expected_nope = [int(uses_rope(i % PATTERN)) for i in range(layers)]
  if list(given) != expected_nope:
    raise HFError(
        f"{CONFIG_FILE}: no_rope_layers={given!r} (or no_rope_layer_interval={interval}) is not supported; maxbridge's "
        f"llama4 has a NoPE layer every {PATTERN} layers"
    )
  step = get_int(hf, "interleave_moe_layer_step")
  moe = hf["moe_layers"]
  if moe is None:
    moe = list(range(step - 1, layers, step))
  if step not in MOE_STEPS or list(moe) != list(range(step - 1, layers, step)):
    raise HFError(
        f"{CONFIG_FILE}: moe_layers={moe!r} with interleave_moe_layer_step={step} is not supported; maxbridge's "
        f"llama4 makes every step-th layer MoE, step in {MOE_STEPS}"
    )
  kinds = hf["layer_types"]
  expected_kinds = ["chunked_attention" if rope else "full_attention" for rope in expected_nope]
  if kinds is not None and list(kinds) != expected_kinds:
    raise HFError(f"{CONFIG_FILE}: layer_types={kinds!r} must be {expected_kinds!r} (chunked RoPE layers, full NoPE)")
  return step


def _config_from_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
  hf = CONFIG_CLASS.read(raw)
  require(hf, "attention_bias", False, False)
  layers = get_int(hf, "num_hidden_layers")
  step = _layers_as_blocks(hf, layers)
  chunk = hf.get("attention_chunk_size")
  if chunk is None or get_int(hf, "attention_chunk_size") <= 0:
    raise HFError(f"{CONFIG_FILE}: attention_chunk_size={chunk!r} must be a positive integer")
  # Some released configs hold attn_temperature_tuning as a number (4): transformers reads its truth.
  tuning = get(hf, "attn_temperature_tuning")
  if not isinstance(tuning, (bool, int)):
    raise HFError(f"{CONFIG_FILE}: attn_temperature_tuning={tuning!r} must be a boolean")
  # transformers adds the router's auxiliary loss only where output_router_logits asks for router logits.
  aux = get_float(hf, "router_aux_loss_coef") if get_bool(hf, "output_router_logits") else 0.0
  dense = llama.config_from_hf("llama4", CONFIG_CLASS)(raw)
  return {
      **dense,
      "base_mlp_dim": get_int(hf, "intermediate_size_mlp"),
      "use_qk_norm": get_bool(hf, "use_qk_norm"),
      "chunk_attn_window_size": get_int(hf, "attention_chunk_size"),
      "nope_layer_interval": PATTERN,
      "interleave_moe_layer_step": step,
      "temperature_tuning": bool(tuning),
      "temperature_tuning_scale": get_float(hf, "attn_scale"),
      "temperature_tuning_floor_scale": get_float(hf, "floor_scale"),
      "num_experts": get_int(hf, "num_local_experts"),
      "num_experts_per_tok": get_int(hf, "num_experts_per_tok"),
      "moe_mlp_dim": get_int(hf, "intermediate_size"),
      "shared_experts": 1,
      "load_balance_loss_weight": aux,
  }


def _config_to_hf(config: Config) -> dict[str, Any]:
  if config.shared_experts != 1:
    raise HFError(f"shared_experts={config.shared_experts}: Hugging Face's Llama 4 has one shared expert of moe_mlp_dim")
  floor = config.temperature_tuning_floor_scale
  if not float(floor).is_integer():
    raise HFError(f"temperature_tuning_floor_scale={floor} has no Hugging Face equivalent: its floor_scale is an integer")
  hf = llama.config_to_hf("llama4_text", qk_norm=config.use_qk_norm)(config)
  layers = config.num_decoder_layers
  step = config.interleave_moe_layer_step
  nope = [int(uses_rope(i % PATTERN)) for i in range(layers)]
  hf.update(
      intermediate_size=config.moe_mlp_dim,
      intermediate_size_mlp=config.mlp_dim,
      num_local_experts=config.num_experts,
      num_experts_per_tok=config.num_experts_per_tok,
      interleave_moe_layer_step=step,
      moe_layers=list(range(step - 1, layers, step)),
      use_qk_norm=config.use_qk_norm,
      no_rope_layer_interval=PATTERN,
      no_rope_layers=nope,
      layer_types=["chunked_attention" if rope else "full_attention" for rope in nope],
      attention_chunk_size=config.chunk_attn_window_size,
      attn_temperature_tuning=config.temperature_tuning,
      attn_scale=config.temperature_tuning_scale,
      floor_scale=int(floor),
      attention_bias=False,
      router_jitter_noise=0.0,
      output_router_logits=config.load_balance_loss_weight > 0,
  )
  if config.load_balance_loss_weight > 0:  # else an imported config's coefficient is kept, and unused
    hf["router_aux_loss_coef"] = config.load_balance_loss_weight
  return hf


def _chunk_rings(config: Config) -> dict[str, int]:
  """A chunked layer's decode cache: a ring of one chunk, which holds every key its queries may see."""
  return {name: config.chunk_attn_window_size for i, name in enumerate(SUBLAYERS) if uses_rope(i)}


def _check(config: Config) -> list[str]:
  layers = pattern = steps = chunk = routing = window = None
  if config.num_decoder_layers % PATTERN:
    layers = (
        f"decoder_block='llama4' stacks blocks of {PATTERN} layers: base_num_decoder_layers="
        f"{config.num_decoder_layers} must be a multiple of {PATTERN}"
    )
  if config.nope_layer_interval != PATTERN:
    pattern = (
        f"decoder_block='llama4' has a NoPE layer every {PATTERN} layers: nope_layer_interval="
        f"{config.nope_layer_interval} must be {PATTERN}"
    )
  if config.interleave_moe_layer_step not in MOE_STEPS:
    steps = f"interleave_moe_layer_step={config.interleave_moe_layer_step} must be one of {MOE_STEPS} (a divisor of {PATTERN})"
  if not config.chunk_attn_window_size:
    chunk = "decoder_block='llama4' attends in chunks on its RoPE layers: set chunk_attn_window_size > 0"
  if config.routed_score_func or config.routed_bias or config.routed_scaling_factor != 1.0:
    routing = (
        f"decoder_block='llama4' routes by a sigmoid of each chosen expert's logit: routed_score_func="
        f"{config.routed_score_func!r}, routed_bias={config.routed_bias} and routed_scaling_factor="
        f"{config.routed_scaling_factor} must stay '', false and 1"
    )
  if config.sliding_window_size:
    window = f"decoder_block='llama4' has no sliding window (sliding_window_size={config.sliding_window_size}): use chunk_attn_window_size"
  clip = None
  if config.use_qk_clip:
    clip = (
        "use_qk_clip=true with decoder_block='llama4': a block of four layers reports no per-layer max logits, "
        "and its RoPE layers' QK-norm already bounds them; set use_qk_clip=false"
    )
  return broken(layers, pattern, steps, chunk, routing, window, clip, routes_to_experts(config))


def attention(config: Config, *, local: bool = False, kv_shared: bool = False) -> attn.AttentionSpec:
  """A `local` layer is chunked, turned by interleaved RoPE and L2-normed (use_qk_norm); the other is NoPE, global
  and temperature-tuned (temperature_tuning)."""
  del kv_shared
  return attn.AttentionSpec(
      head_dim=config.head_dim,
      kv_heads=config.num_kv_heads,
      qk_norm=attn.L2 if local and config.use_qk_norm else None,
      rope=attn.INTERLEAVED_ROPE if local else attn.NO_ROPE,
      chunk_size=config.chunk_attn_window_size if local else 0,
      ring_cache=local,  # a ring of one chunk (`Stack.rings`)
      query_scale=config.head_dim**-0.5,
      temperature_tuning=not local and config.temperature_tuning,
  )


FAMILY = Family(
    decoder_blocks=("llama4",),
    stacks=(
        Stack(
            "layers",
            "llama4",
            depth=lambda config: config.num_decoder_layers // PATTERN,
            sublayers=SUBLAYERS,
            rings=_chunk_rings,
        ),
    ),
    attention=attention,
    norm="rms_norm",
    query_kernel_carries_scale=False,  # the QK-norm of the RoPE layers would undo it
    cache_entries=key_value_cache,
    qk_clip_targets=query_kernel_clip,  # unused: the family refuses QK-Clip
    hf=(HFFamily("llama4_text", "Llama4ForCausalLM", ("llama4",), RULES, _config_from_hf, _config_to_hf, CONFIG_CLASS),),
    check=_check,
    ring_cache=False,  # no sliding window: the chunked layers keep their own rings (`_chunk_rings`)
    routing="topk_sigmoid",
    own_keys={
        "chunk_attn_window_size": 0,
        "nope_layer_interval": -1,
        "interleave_moe_layer_step": 1,
        "temperature_tuning": False,
        "temperature_tuning_scale": 0.1,
        "temperature_tuning_floor_scale": 8192.0,
    },
)
