"""Every field of every family's transformers config class: honoured exactly, refused by name, or ignored.

`maxbridge/interop/hf/FIELDS.md` classifies each field. Here: the table covers
every field of each transformers class (a new transformers field fails until it
is classified); each `refused` row has a case whose import raises `HFError`
naming the field; each `honoured` row has a case where a non-default value,
written into a tiny model's config.json, gives the logits transformers computes
from that same folder; and our copies of the class defaults are transformers'.
"""

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge.interop import hf  # noqa: E402
from test_hf import LOGITS_TOL, max_diff, randomize  # noqa: E402

FIELDS_MD = Path(hf.__file__).parent / "FIELDS.md"
TOKENS = np.random.default_rng(0).integers(0, 64, (2, 10))
DIMS = dict(
    hidden_size=32,
    num_hidden_layers=2,
    vocab_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=48,
    rms_norm_eps=1e-3,
    initializer_range=0.1,
)
# Each family's transformers classes and a tiny config whose sizes all differ from the class defaults.
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {**DIMS, "head_dim": 16}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {**DIMS, "sliding_window": 4}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**DIMS, "head_dim": 8}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", DIMS),
    "gpt2": (
        "GPT2Config",
        "GPT2LMHeadModel",
        dict(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=16, layer_norm_epsilon=1e-3),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {**DIMS, "num_local_experts": 4, "num_experts_per_tok": 3}),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            vocab_size=64,
            num_attention_heads=4,
            num_key_value_heads=4,
            intermediate_size=48,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=2,
            q_lora_rank=16,
            kv_lora_rank=8,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            routed_scaling_factor=1.5,
            rms_norm_eps=1e-3,
            initializer_range=0.1,
        ),
    ),
    # DeepSeek-V2 236B's routing: the best 2 of 4 groups by their best expert, 3 experts a token from them.
    "deepseek_v2": (
        "DeepseekV2Config",
        "DeepseekV2ForCausalLM",
        dict(
            DIMS,
            num_key_value_heads=4,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=3,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=1,
            q_lora_rank=16,
            kv_lora_rank=8,
            qk_nope_head_dim=8,
            qk_rope_head_dim=4,
            v_head_dim=6,
            routed_scaling_factor=1.5,
        ),
    ),
    # GLM-4.5's routing with a group limit: the best 2 of 4 groups, 3 experts a token from them.
    "glm4_moe": (
        "Glm4MoeConfig",
        "Glm4MoeForCausalLM",
        dict(
            DIMS,
            moe_intermediate_size=16,
            n_routed_experts=8,
            num_experts_per_tok=3,
            n_group=4,
            topk_group=2,
            first_k_dense_replace=1,
            n_shared_experts=2,
            routed_scaling_factor=1.5,
            attention_bias=True,
        ),
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", DIMS),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {**DIMS, "num_hidden_layers": 4, "sliding_window": 3}),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {**DIMS, "head_dim": 8, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 3},
    ),
    "gemma": ("GemmaConfig", "GemmaForCausalLM", {**DIMS, "head_dim": 16}),
    # A window and caps the tiny model's numbers reach.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            **DIMS,
            "head_dim": 16,
            "sliding_window": 3,
            "query_pre_attn_scalar": 12,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
        },
    ),
    # One block of five windowed layers and a full one; each layer kind's own RoPE, the full one's linear.
    "gemma3_text": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            **DIMS,
            "num_hidden_layers": 6,
            "head_dim": 16,
            "sliding_window": 3,
            "query_pre_attn_scalar": 12,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "rope_parameters": {
                "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 20000.0},
            },
        },
    ),
    # One block of five windowed layers and a full one, wider, with k = v and proportional RoPE; per-layer inputs.
    "gemma4_text": (
        "Gemma4TextConfig",
        "Gemma4ForCausalLM",
        {
            **DIMS,
            "num_hidden_layers": 6,
            "head_dim": 16,
            "sliding_window": 3,
            "final_logit_softcapping": 3.0,
            "vocab_size_per_layer_input": 64,
            "hidden_size_per_layer_input": 4,
        },
    ),
    # Blocks of a windowed then a full layer; GptOssConfig's default RoPE is YaRN.
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {**DIMS, "head_dim": 8, "sliding_window": 3, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    # One block of three DeltaNet layers and a full one; every DeltaNet size differs from the others.
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        {
            **DIMS,
            "num_hidden_layers": 4,
            "head_dim": 8,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 3,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            "linear_key_head_dim": 4,
            "linear_value_head_dim": 6,
            "linear_conv_kernel_dim": 3,
        },
    ),
    # One block of three chunked RoPE layers and a NoPE one, dense and MoE alternating; a chunk and a
    # temperature floor the test's ten positions cross.
    "llama4_text": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        {
            **DIMS,
            "num_hidden_layers": 4,
            "head_dim": 8,
            "intermediate_size": 16,
            "intermediate_size_mlp": 40,
            "num_local_experts": 4,
            "interleave_moe_layer_step": 2,
            "attention_chunk_size": 3,
            "floor_scale": 2,
            "attn_scale": 0.5,
        },
    ),
}
DELETE = object()  # a json edit that removes the key


@dataclasses.dataclass(frozen=True)
class Case:
  family: str
  fields: tuple[str, ...]  # the FIELDS.md rows this case covers ("all" rows too)
  build: dict = dataclasses.field(default_factory=dict)  # constructor arguments beyond FAMILIES'
  edit: dict = dataclasses.field(default_factory=dict)  # then written into config.json as is
  expect: dict = dataclasses.field(default_factory=dict)  # our config's values, beyond the logits

  @property
  def id(self) -> str:
    return f"{self.family}-{'+'.join(self.fields)[:60]}"


_LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 5e5}
_SIZES = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "rms_norm_eps",
)
_GLM_ROPE = {"rope_type": "default", "rope_theta": 5e5, "partial_rotary_factor": 0.25}
HONOURED = [
    Case("llama", (*_SIZES, "head_dim")),
    Case("llama", ("tie_word_embeddings",), build={"tie_word_embeddings": True}),
    # Llama 3.1's original_max_position_embeddings defaults to max_position_embeddings.
    Case(
        "llama",
        ("rope_parameters", "max_position_embeddings"),
        build={"rope_parameters": dict(_LLAMA3), "max_position_embeddings": 6},  # transformers fills in its dict
        edit={"rope_parameters": dict(_LLAMA3), "max_position_embeddings": 6},
        expect={"original_max_position_embeddings": 6, "rope_max_timescale": 500000},
    ),
    # The legacy rope_scaling replaces rope_parameters whole; the top-level rope_theta fills in its theta.
    Case(
        "all",
        ("rope_scaling", "rope_theta"),
        edit={
            "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
            "rope_scaling": {
                **{k: v for k, v in _LLAMA3.items() if k not in ("rope_type", "rope_theta")},
                "type": "llama3",
            },
            "rope_theta": 2e4,
            "max_position_embeddings": 6,
        },
        expect={"rope_type": "llama3.1", "rope_max_timescale": 20000},
    ),
    Case("llama", ("hidden_act",), edit={"hidden_act": "swish"}),
    Case("mistral", (*_SIZES, "head_dim", "sliding_window")),
    Case(
        "mistral",
        ("tie_word_embeddings", "rope_parameters", "max_position_embeddings"),
        build={"tie_word_embeddings": True},
    ),
    Case("mistral", ("sliding_window",), edit={"sliding_window": None}, expect={"sliding_window_size": 0}),
    Case("mistral", ("sliding_window",), edit={"sliding_window": DELETE}, expect={"sliding_window_size": 4096}),
    Case("qwen3", (*_SIZES, "head_dim", "rope_parameters", "max_position_embeddings")),
    Case("qwen3", ("tie_word_embeddings",), build={"tie_word_embeddings": True}),
    # A window from max_window_layers on: none of the two layers.
    Case(
        "qwen3",
        ("use_sliding_window", "sliding_window", "max_window_layers"),
        edit={"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2, "layer_types": None},
    ),
    Case("qwen2", (*_SIZES, "rope_parameters", "max_position_embeddings")),
    # Not a field, but Qwen2's attention reads it: projections of heads * 16 from a width of 32.
    Case("qwen2", ("head_dim", "tie_word_embeddings"), build={"head_dim": 16, "tie_word_embeddings": True}),
    Case(
        "qwen2",
        ("use_sliding_window", "sliding_window", "max_window_layers"),
        edit={"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 2, "layer_types": None},
    ),
    Case(
        "gpt2",
        ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon", "tie_word_embeddings"),
        build={"tie_word_embeddings": False},
    ),
    Case("gpt2", ("n_inner", "reorder_and_upcast_attn"), build={"n_inner": 40, "reorder_and_upcast_attn": True}),
    Case("gpt2", ("activation_function",), build={"activation_function": "gelu_pytorch_tanh"}),
    Case("gpt2", ("activation_function",), build={"activation_function": "gelu_fast"}),
    # An alias (attribute_map) wins over the field it names.
    Case(
        "gpt2",
        ("hidden_size", "max_position_embeddings", "num_attention_heads", "num_hidden_layers"),
        edit={
            "n_embd": 48,
            "hidden_size": 32,
            "n_positions": 99,
            "max_position_embeddings": 16,
            "n_head": 2,
            "num_attention_heads": 4,
            "n_layer": 5,
            "num_hidden_layers": 2,
        },
        expect={"trainable_position_size": 16},
    ),
    Case("mixtral", (*_SIZES, "head_dim", "num_experts_per_tok", "num_local_experts")),
    Case("mixtral", ("sliding_window", "tie_word_embeddings"), build={"sliding_window": 4, "tie_word_embeddings": True}),
    # The class's own defaults: rope theta 1e6 and rms_norm_eps 1e-5.
    Case(
        "mixtral",
        ("rope_parameters", "max_position_embeddings", "rms_norm_eps"),
        edit={"rope_parameters": DELETE, "rope_theta": DELETE, "rms_norm_eps": DELETE},
        expect={"rope_max_timescale": 1000000, "normalization_layer_epsilon": 1e-5},
    ),
    Case("mixtral", ("num_experts",), edit={"num_local_experts": 9, "num_experts": 4}, expect={"num_experts": 4}),
    Case(
        "mixtral",
        ("output_router_logits", "router_aux_loss_coef"),
        edit={"output_router_logits": True, "router_aux_loss_coef": 0.25},
        expect={"load_balance_loss_weight": 0.25},
    ),
    Case(
        "mixtral", ("router_aux_loss_coef",), edit={"router_aux_loss_coef": 0.25}, expect={"load_balance_loss_weight": 0}
    ),
    Case(
        "deepseek_v3",
        (
            *_SIZES,
            "moe_intermediate_size",
            "n_shared_experts",
            "n_routed_experts",
            "routed_scaling_factor",
            "kv_lora_rank",
            "q_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
            "qk_nope_head_dim",
            "n_group",
            "topk_group",
            "num_experts_per_tok",
            "first_k_dense_replace",
            "rope_parameters",
        ),
    ),
    Case("deepseek_v3", ("q_lora_rank", "tie_word_embeddings"), build={"q_lora_rank": None, "tie_word_embeddings": True}),
    Case("deepseek_v3", ("num_local_experts",), edit={"n_routed_experts": 16, "num_local_experts": 8}),
    Case(
        "deepseek_v2",
        (
            *_SIZES,
            "moe_intermediate_size",
            "n_shared_experts",
            "n_routed_experts",
            "kv_lora_rank",
            "routed_scaling_factor",
            "q_lora_rank",
            "qk_rope_head_dim",
            "v_head_dim",
            "qk_nope_head_dim",
            "n_group",
            "topk_group",
            "topk_method",
            "num_experts_per_tok",
            "first_k_dense_replace",
            "rope_parameters",
        ),
    ),
    Case(
        "deepseek_v2",
        ("q_lora_rank", "tie_word_embeddings", "topk_method"),
        build={"q_lora_rank": None, "tie_word_embeddings": True, "topk_method": "greedy"},
    ),
    Case("deepseek_v2", ("num_experts",), edit={"n_routed_experts": 16, "num_experts": 8}),
    Case(
        "glm4_moe",
        (*_SIZES, "head_dim", "moe_intermediate_size", "n_shared_experts", "n_routed_experts", "num_local_experts"),
        build={"head_dim": 16},
        edit={"n_routed_experts": 16, "num_local_experts": 8},
    ),
    Case(
        "glm4_moe",
        (
            *("routed_scaling_factor", "n_group", "topk_group", "num_experts_per_tok", "first_k_dense_replace"),
            *("rope_parameters", "use_qk_norm", "tie_word_embeddings"),
        ),
        build={"use_qk_norm": True, "tie_word_embeddings": True, "rope_parameters": _GLM_ROPE},
        expect={"partial_rotary_factor": 0.25, "use_qk_norm": True, "rope_max_timescale": 500000},
    ),
    Case("glm4_moe", ("partial_rotary_factor",), edit={"partial_rotary_factor": 0.25, "rope_parameters": None}),
    Case("olmo2", (*_SIZES, "rope_parameters", "max_position_embeddings")),
    # Not a field, but OLMo 2's attention reads it: projections of heads * 16 from a width of 32.
    Case("olmo2", ("head_dim", "tie_word_embeddings"), build={"head_dim": 16, "tie_word_embeddings": True}),
    Case("olmo2", ("rms_norm_eps",), edit={"rms_norm_eps": DELETE}, expect={"normalization_layer_epsilon": 1e-5}),
    Case("olmo3", (*_SIZES, "sliding_window", "max_position_embeddings"), expect={"sliding_window_size": 3}),
    Case(
        "olmo3",
        ("head_dim", "tie_word_embeddings", "layer_types"),
        build={"head_dim": 16, "tie_word_embeddings": True},
        edit={"layer_types": None},
    ),
    # Per layer kind; the flat keys beside them are not read (both kinds keep the class's 500000).
    Case(
        "olmo3",
        ("rope_parameters",),
        edit={"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
        expect={"rope_max_timescale": 500000},
    ),
    Case(
        "olmo3",
        ("rope_parameters",),
        edit={
            "rope_parameters": {
                kind: {"rope_type": "default", "rope_theta": 2e4} for kind in ("sliding_attention", "full_attention")
            }
        },
        expect={"rope_max_timescale": 20000},
    ),
    Case(
        "qwen3_moe",
        (*_SIZES, "head_dim", "moe_intermediate_size", "num_experts_per_tok", "num_local_experts", "norm_topk_prob"),
        expect={"moe_mlp_dim": 16, "num_experts": 4, "routed_score_func": "softmax", "norm_topk_prob": False},
    ),
    Case(
        "qwen3_moe",
        ("norm_topk_prob", "tie_word_embeddings"),
        build={"norm_topk_prob": True, "tie_word_embeddings": True},
        expect={"norm_topk_prob": True},
    ),
    Case(
        "qwen3_moe",
        ("use_sliding_window", "sliding_window"),
        build={"use_sliding_window": True, "sliding_window": 4},
        expect={"sliding_window_size": 4},
    ),
    # num_experts is the field, yet the alias num_local_experts (what save_pretrained writes) wins.
    Case(
        "qwen3_moe",
        ("num_experts",),
        build={"num_experts": 3},
        edit={"num_local_experts": DELETE, "num_experts": 3},
        expect={"num_experts": 3},
    ),
    Case("gemma", (*_SIZES, "head_dim", "tie_word_embeddings", "rope_parameters", "max_position_embeddings")),
    Case("gemma", ("hidden_act", "tie_word_embeddings"), build={"hidden_act": "gelu_new", "tie_word_embeddings": False}),
    Case(
        "gemma2",
        (
            *_SIZES,
            "head_dim",
            "tie_word_embeddings",
            "rope_parameters",
            "max_position_embeddings",
            "query_pre_attn_scalar",
            "sliding_window",
            "layer_types",
            "final_logit_softcapping",
            "attn_logit_softcapping",
        ),
        expect={"sliding_window_size": 3, "num_decoder_layers": 1, "query_pre_attn_scalar": 12},
    ),
    Case(
        "gemma2",
        ("layer_types", "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation"),
        edit={
            "layer_types": None,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "hidden_activation": "gelu_fast",
        },
        expect={"final_logits_soft_cap": 0.0, "attn_logits_soft_cap": 0.0},
    ),
    Case(
        "gemma3_text",
        (
            *_SIZES,
            "head_dim",
            "tie_word_embeddings",
            "rope_parameters",
            "max_position_embeddings",
            "query_pre_attn_scalar",
            "sliding_window",
            "layer_types",
            "final_logit_softcapping",
        ),
        # transformers' Gemma3 keeps attn_logit_softcapping (2.0 here) unused: so do we.
        expect={
            "sliding_window_size": 3,
            "num_decoder_layers": 6,
            "local_rope_max_timescale": 100,
            "attn_logits_soft_cap": 0.0,
        },
    ),
    # A hub config.json's spelling: the legacy RoPE keys and window pattern, no caps.
    Case(
        "gemma3_text",
        ("rope_theta", "rope_local_base_freq", "rope_scaling", "sliding_window_pattern", "hidden_activation"),
        edit={
            "rope_parameters": DELETE,
            "layer_types": DELETE,
            "rope_theta": 30000.0,
            "rope_local_base_freq": 50.0,
            "rope_scaling": {"rope_type": "linear", "factor": 3.0},
            "sliding_window_pattern": 6,
            "final_logit_softcapping": None,
            "attn_logit_softcapping": None,
            "hidden_activation": "gelu_fast",
        },
        expect={"rope_max_timescale": 30000, "local_rope_max_timescale": 50, "rope_linear_scaling_factor": 3.0},
    ),
    Case("qwen3_moe", ("num_local_experts",), edit={"num_local_experts": 4, "num_experts": 8}, expect={"num_experts": 4}),
    Case(
        "gpt_oss",
        (*_SIZES, "head_dim", "sliding_window", "layer_types", "num_local_experts", "num_experts_per_tok"),
        edit={"layer_types": None},
        expect={"sliding_window_size": 3, "num_experts": 4, "num_decoder_layers": 2},
    ),
    # Absent: GptOssConfig's YaRN (factor 32 over 4096 positions, truncate false).
    Case(
        "gpt_oss",
        ("rope_parameters", "swiglu_limit", "tie_word_embeddings"),
        build={"swiglu_limit": 0.3, "tie_word_embeddings": True},
        edit={"rope_parameters": DELETE},
        expect={"rope_type": "yarn", "rope_factor": 32.0, "rope_truncate": False, "mlp_activations_limit": 0.3},
    ),
    # A YaRN whose ramp falls inside the test's positions; its original length defaults to max_position_embeddings.
    Case(
        "gpt_oss",
        ("rope_parameters", "max_position_embeddings"),
        build={"max_position_embeddings": 16},
        edit={
            "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0, "beta_fast": 8.0, "truncate": True}
        },
        expect={"original_max_position_embeddings": 16, "beta_fast": 8.0, "rope_max_timescale": 10000},
    ),
    # num_experts is the alias (attribute_map) of num_local_experts, and wins when both are given.
    Case("gpt_oss", ("num_experts",), edit={"num_experts": 4, "num_local_experts": 8}, expect={"num_experts": 4}),
    Case(
        "gpt_oss",
        ("output_router_logits", "router_aux_loss_coef"),
        edit={"output_router_logits": True, "router_aux_loss_coef": 0.25},
        expect={"load_balance_loss_weight": 0.25},
    ),
    Case(
        "qwen3_moe",
        ("rope_parameters", "max_position_embeddings", "rms_norm_eps"),
        edit={"rope_parameters": DELETE, "rope_theta": DELETE, "rms_norm_eps": DELETE},
        expect={"rope_max_timescale": 10000, "normalization_layer_epsilon": 1e-6},
    ),
    Case(
        "qwen3_moe",
        ("output_router_logits", "router_aux_loss_coef"),
        edit={"output_router_logits": True, "router_aux_loss_coef": 0.25},
        expect={"load_balance_loss_weight": 0.25},
    ),
    Case(
        "qwen3_next",
        (
            *_SIZES,
            "head_dim",
            "max_position_embeddings",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "num_experts",
            "num_experts_per_tok",
            "norm_topk_prob",
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
            "output_router_logits",
            "router_aux_loss_coef",
        ),
        build={"norm_topk_prob": False},
        edit={"output_router_logits": True, "router_aux_loss_coef": 0.25},
        expect={"shared_experts": 2, "gdn_conv_kernel_dim": 3, "norm_topk_prob": False, "load_balance_loss_weight": 0.25},
    ),
    # The RoPE dict's own fraction, then a top-level one filling in a dict that lacks it; layer_types null.
    Case(
        "qwen3_next",
        ("rope_parameters", "tie_word_embeddings", "layer_types"),
        build={"tie_word_embeddings": True},
        edit={
            "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
            "layer_types": None,
        },
        expect={"partial_rotary_factor": 0.5, "rope_max_timescale": 500},
    ),
    Case(
        "qwen3_next",
        ("partial_rotary_factor",),
        edit={"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "partial_rotary_factor": 1.0},
        expect={"partial_rotary_factor": 1.0},
    ),
    Case(
        "llama4_text",
        (
            *_SIZES,
            "head_dim",
            "intermediate_size_mlp",
            "num_local_experts",
            "num_experts_per_tok",
            "interleave_moe_layer_step",
            "attention_chunk_size",
            "attn_temperature_tuning",
            "floor_scale",
            "attn_scale",
            "use_qk_norm",
        ),
        build={"num_experts_per_tok": 2},
        expect={
            "chunk_attn_window_size": 3,
            "num_experts": 4,
            "interleave_moe_layer_step": 2,
            "temperature_tuning": True,
        },
    ),
    Case(
        "llama4_text",
        ("use_qk_norm", "attn_temperature_tuning", "tie_word_embeddings", "interleave_moe_layer_step"),
        build={
            "use_qk_norm": False,
            "attn_temperature_tuning": False,
            "tie_word_embeddings": True,
            "interleave_moe_layer_step": 1,
        },
        # Every layer MoE, and moe_layers derived from the step, as Llama4TextConfig's __post_init__ does.
        edit={"interleave_moe_layer_step": 1, "moe_layers": None},
        expect={"use_qk_norm": False, "temperature_tuning": False, "interleave_moe_layer_step": 1},
    ),
    Case(
        "llama4_text",
        ("rope_parameters", "max_position_embeddings"),
        build={"rope_parameters": dict(_LLAMA3), "max_position_embeddings": 6},
        edit={"rope_parameters": dict(_LLAMA3), "max_position_embeddings": 6},
        expect={"original_max_position_embeddings": 6, "rope_max_timescale": 500000},
    ),
    Case(
        "llama4_text",
        ("output_router_logits", "router_aux_loss_coef"),
        edit={"output_router_logits": True, "router_aux_loss_coef": 0.25},
        expect={"load_balance_loss_weight": 0.25},
    ),
]

_GEMMA4_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5, "rope_theta": 20000.0},
}
HONOURED += [
    # Two blocks, the second sharing the first's keys/values; every size its own.
    Case(
        "gemma4_text",
        (
            *_SIZES,
            "head_dim",
            "max_position_embeddings",
            "tie_word_embeddings",
            "rope_parameters",
            "sliding_window",
            "layer_types",
            "final_logit_softcapping",
            "vocab_size_per_layer_input",
            "hidden_size_per_layer_input",
            "attention_k_eq_v",
            "num_kv_shared_layers",
        ),
        build={
            "num_hidden_layers": 12,
            "num_kv_shared_layers": 6,
            "attention_k_eq_v": True,
            "global_head_dim": 24,
            "num_global_key_value_heads": 1,
            "rope_parameters": _GEMMA4_ROPE,
            "max_position_embeddings": 6,
            "tie_word_embeddings": False,
        },
        expect={"global_head_dim": 24, "global_num_kv_heads": 1, "global_rope_proportion": 0.5},
    ),
    Case(
        "gemma4_text",
        ("enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size"),
        build={"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8},
        expect={"num_experts": 4, "num_experts_per_tok": 2, "moe_mlp_dim": 8},
    ),
]

# (family, field, config.json edit, what the message must say); "all" rows are tried on llama.
REFUSED = [
    ("gemma4_text", "hidden_activation", {"hidden_activation": "silu"}, "hidden_activation='silu'"),
    ("gemma4_text", "attention_bias", {"attention_bias": True}, "attention_bias=True"),
    (
        "gemma4_text",
        "use_bidirectional_attention",
        {"use_bidirectional_attention": "all"},
        "use_bidirectional_attention='all'",
    ),
    ("gemma4_text", "use_double_wide_mlp", {"use_double_wide_mlp": True}, "use_double_wide_mlp=True"),
    ("all", "partial_rotary_factor", {"partial_rotary_factor": 0.5}, r"partial_rotary_factor=0\.5"),
    ("all", "quantization_config", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config is set"),
    ("all", "per_layer_config", {"per_layer_config": {"0": {"intermediate_size": 8}}}, "per_layer_config is set"),
    ("llama", "hidden_act", {"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
    ("llama", "attention_bias", {"attention_bias": True}, "attention_bias=True is not supported"),
    ("llama", "mlp_bias", {"mlp_bias": True}, "mlp_bias=True is not supported"),
    (
        "llama",
        "rope_parameters",
        {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
        r"rope_parameters\.rope_type='dynamic'",
    ),
    ("mistral", "hidden_act", {"hidden_act": "relu"}, "hidden_act='relu'"),
    ("qwen3", "hidden_act", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen3", "attention_bias", {"attention_bias": True}, "attention_bias=True"),
    (
        "qwen3",
        "use_sliding_window",
        {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1, "layer_types": None},
        r"use_sliding_window=true with max_window_layers=1 gives layers \[1\] a sliding window",
    ),
    ("qwen3", "layer_types", {"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types gives layers \[1\]"),
    ("qwen2", "hidden_act", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    (
        "qwen2",
        "use_sliding_window",
        {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1, "layer_types": None},
        r"use_sliding_window=true with max_window_layers=1 gives layers \[1\] a sliding window",
    ),
    ("qwen2", "layer_types", {"layer_types": ["full_attention", "sliding_attention"]}, r"layer_types gives layers \[1\]"),
    ("gpt2", "activation_function", {"activation_function": "relu"}, "activation_function='relu'"),
    ("gpt2", "scale_attn_weights", {"scale_attn_weights": False}, "scale_attn_weights=False"),
    (
        "gpt2",
        "scale_attn_by_inverse_layer_idx",
        {"scale_attn_by_inverse_layer_idx": True},
        "scale_attn_by_inverse_layer_idx=True",
    ),
    ("gpt2", "add_cross_attention", {"add_cross_attention": True}, "add_cross_attention=True"),
    ("gpt2", "head_dim", {"head_dim": 4}, r"head_dim=4 is not n_embd / n_head = 8"),
    ("mixtral", "hidden_act", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("deepseek_v3", "hidden_act", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("deepseek_v3", "norm_topk_prob", {"norm_topk_prob": False}, "norm_topk_prob=False"),
    ("deepseek_v3", "rope_interleave", {"rope_interleave": False}, "rope_interleave=False"),
    ("deepseek_v3", "attention_bias", {"attention_bias": True}, "attention_bias=True"),
    ("deepseek_v3", "scoring_func", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v3", "topk_method", {"topk_method": "greedy"}, "topk_method='greedy'"),
    ("olmo2", "hidden_act", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("olmo2", "attention_bias", {"attention_bias": True}, "attention_bias=True"),
    ("olmo3", "hidden_act", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("olmo3", "attention_bias", {"attention_bias": True}, "attention_bias=True"),
    ("olmo3", "layer_types", {"layer_types": ["full_attention"] * 4}, r"layer_types=\['full_attention'"),
    ("olmo3", "rope_theta", {"rope_parameters": None, "rope_theta": 2e4}, "with rope_theta and rope_scaling"),
    ("olmo3", "rope_scaling", {"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_scaling gives"),
    ("gemma", "hidden_act", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("gemma", "attention_bias", {"attention_bias": True}, "attention_bias=True"),
    ("gemma", "use_bidirectional_attention", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
    ("gemma2", "hidden_activation", {"hidden_activation": "silu"}, "hidden_activation='silu'"),
    ("gemma2", "attention_bias", {"attention_bias": True}, "attention_bias=True"),
    (
        "gemma2",
        "use_bidirectional_attention",
        {"use_bidirectional_attention": True},
        "use_bidirectional_attention=True",
    ),
    ("gemma3_text", "hidden_activation", {"hidden_activation": "silu"}, "hidden_activation='silu'"),
    ("gemma3_text", "attention_bias", {"attention_bias": True}, "attention_bias=True"),
    (
        "gemma3_text",
        "use_bidirectional_attention",
        {"use_bidirectional_attention": True},
        "use_bidirectional_attention=True",
    ),
    ("qwen3_moe", "hidden_act", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen3_moe", "attention_bias", {"attention_bias": True}, "attention_bias=True"),
    ("qwen3_moe", "decoder_sparse_step", {"decoder_sparse_step": 2}, "decoder_sparse_step=2 gives some layers a dense"),
    ("qwen3_moe", "mlp_only_layers", {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\] gives those layers a dense"),
    *(
        ("deepseek_v2", field, {field: value}, f"{field}={value!r}")
        for field, value in (
            ("hidden_act", "gelu"),
            ("norm_topk_prob", True),
            ("attention_bias", True),
            ("mlp_bias", True),
            ("topk_method", "noaux_tc"),
            ("scoring_func", "sigmoid"),
            ("moe_layer_freq", 2),
        )
    ),
    *(
        ("glm4_moe", field, {field: value}, f"{field}={value!r}")
        for field, value in (("hidden_act", "gelu"), ("attention_bias", False), ("norm_topk_prob", False))
    ),
    ("qwen3_next", "hidden_act", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("qwen3_next", "attention_bias", {"attention_bias": True}, "attention_bias=True"),
    ("qwen3_next", "decoder_sparse_step", {"decoder_sparse_step": 2}, "decoder_sparse_step=2 gives some layers a dense"),
    ("qwen3_next", "mlp_only_layers", {"mlp_only_layers": [0]}, r"mlp_only_layers=\[0\] gives those layers a dense"),
    ("qwen3_next", "layer_types", {"layer_types": ["full_attention"] * 4}, r"layer_types=\['full_attention'"),
    (
        "qwen3_next",
        "shared_expert_intermediate_size",
        {"shared_expert_intermediate_size": 24},
        "shared_expert_intermediate_size=24 must be a positive multiple of moe_intermediate_size=16",
    ),
    ("gpt_oss", "attention_bias", {"attention_bias": False}, "attention_bias=False"),
    ("gpt_oss", "swiglu_alpha", {"swiglu_alpha": 1.5}, "swiglu_alpha=1.5 is not supported"),
    ("gpt_oss", "layer_types", {"layer_types": ["full_attention"] * 2}, r"layer_types=\['full_attention'"),
    ("llama4_text", "hidden_act", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama4_text", "attention_bias", {"attention_bias": True}, "attention_bias=True"),
    ("llama4_text", "moe_layers", {"moe_layers": [0]}, r"moe_layers=\[0\]"),
    ("llama4_text", "no_rope_layers", {"no_rope_layers": [0, 1, 1, 1]}, r"no_rope_layers=\[0, 1, 1, 1\]"),
    (
        "llama4_text",
        "no_rope_layer_interval",
        {"no_rope_layers": None, "no_rope_layer_interval": 2},
        r"no_rope_layer_interval=2",
    ),
    ("llama4_text", "layer_types", {"layer_types": ["full_attention"] * 4}, r"layer_types=\['full_attention'"),
]


def read_table() -> dict[str, dict[str, str]]:
  """{family: {field: status}} from FIELDS.md."""
  table: dict[str, dict[str, str]] = {}
  family = None
  for line in FIELDS_MD.read_text().splitlines():
    if heading := re.match(r"## (\w+)", line):
      family = heading.group(1)
      table[family] = {}
    elif family and (row := re.match(r"\| (\w+) \| (honoured|refused|ignored) \|", line)):
      assert row.group(1) not in table[family], f"{family}.{row.group(1)} is listed twice"
      table[family][row.group(1)] = row.group(2)
  return table


def config_class(family: str):
  return getattr(transformers, FAMILIES[family][0])


# --- the table -------------------------------------------------------------------------------


def test_the_table_classifies_every_field_of_every_config_class():
  table = read_table()
  generic = {field.name for field in dataclasses.fields(transformers.PreTrainedConfig)}
  assert generic <= set(table["all"]), sorted(generic - set(table["all"]))
  for family in FAMILIES:
    cls = config_class(family)
    fields = {field.name for field in dataclasses.fields(cls)} - generic
    fields |= set(cls.attribute_map) | set(cls.attribute_map.values())
    missing = fields - set(table[family])
    assert not missing, f"FIELDS.md's {family} section does not classify {sorted(missing)}"


def test_every_honoured_and_refused_row_has_a_case():
  table = read_table()
  honoured = {(case.family, field) for case in HONOURED for field in case.fields}
  refused = {(family, field) for family, field, _, _ in REFUSED}
  for family, rows in table.items():
    for field, status in rows.items():
      if status == "honoured" and field != "_name_or_path":
        assert (family, field) in honoured, f"no case checks {family}.{field} against transformers"
      if status == "refused":
        assert (family, field) in refused, f"no case checks that {family}.{field} is refused"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_our_class_defaults_are_transformers(family):
  ours = hf.family_for_model_type(family).config_class
  assert ours.name == FAMILIES[family][0]
  defaults = {field.name: field.default for field in dataclasses.fields(config_class(family))}
  for name, value in ours.defaults.items():
    assert (
        name in defaults and defaults[name] == value
    ), f"{family}.{name}: ours {value!r}, transformers {defaults[name]!r}"
  assert ours.default_theta == config_class(family).default_theta
  assert ours.aliases == config_class(family).attribute_map


# --- refused ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved_configs(tmp_path_factory):
  """{family: the config.json transformers' save_pretrained writes for FAMILIES' tiny config}."""
  configs = {}
  for family, (config_name, _, dims) in FAMILIES.items():
    folder = tmp_path_factory.mktemp(family)
    getattr(transformers, config_name)(**dims).save_pretrained(folder)
    configs[family] = json.loads((folder / "config.json").read_text())
  return configs


@pytest.mark.parametrize("family, field, edit, match", REFUSED, ids=[f"{r[0]}-{r[1]}" for r in REFUSED])
def test_a_refused_field_is_named(saved_configs, family, field, edit, match):
  config = {**saved_configs["llama" if family == "all" else family], **edit}
  with pytest.raises(hf.HFError, match=match):
    hf.config_from_hf(config)
  assert field in match.replace("\\", "")


def test_the_default_of_a_refused_field_is_accepted(saved_configs):
  for family, field, edit, _ in REFUSED:
    if family != "all" and field in saved_configs[family]:
      hf.config_from_hf({**saved_configs[family], field: saved_configs[family][field]})


# --- honoured: logits against transformers ------------------------------------------------------


def save_tiny(folder: Path, family: str, build: dict, edit: dict) -> Path:
  """A tiny random model of `family` saved by transformers, then `edit` written into its config.json."""
  config_name, model_name, dims = FAMILIES[family]
  torch.manual_seed(0)
  model = getattr(transformers, model_name)(getattr(transformers, config_name)(**{**dims, **build}))
  randomize(model)
  model.save_pretrained(folder)
  config = json.loads((folder / "config.json").read_text())
  config.update(edit)
  config = {key: value for key, value in config.items() if value is not DELETE}
  (folder / "config.json").write_text(json.dumps(config))
  return folder


def transformers_logits(folder: Path) -> np.ndarray:
  # Eager attention: GPT-2's reorder_and_upcast_attn takes effect only there.
  model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
  with torch.no_grad():
    return model.eval()(torch.tensor(TOKENS)).logits.numpy()


@pytest.mark.parametrize("case", HONOURED, ids=[case.id for case in HONOURED])
def test_an_honoured_field_gives_transformers_logits(case, tmp_path):
  family = "llama" if case.family == "all" else case.family
  folder = save_tiny(tmp_path, family, case.build, case.edit)
  want = transformers_logits(folder)
  assert np.std(want) > 0.1, "logits too flat to tell a wrong reading from a right one"
  model = mb.from_pretrained(folder, backend="linen")
  for key, value in case.expect.items():
    assert getattr(model.config, key) == value, key
  assert max_diff(model.logits(TOKENS), want) <= LOGITS_TOL


# --- the two examples of issue 27 ------------------------------------------------------------


def test_tied_embeddings_beside_a_different_stored_head_read_as_transformers_does(tmp_path):
  """tie_word_embeddings=true, but lm_head.weight is stored and differs: transformers 5.x unties them."""
  folder = save_tiny(tmp_path / "hf", "llama", {}, {"tie_word_embeddings": True})
  want = transformers_logits(folder)
  with pytest.warns(UserWarning, match=r"tie_word_embeddings=true, but lm_head\.weight differs"):
    model = mb.from_pretrained(folder, backend="linen")
  assert not model.config.logits_via_embedding
  assert max_diff(model.logits(TOKENS), want) <= LOGITS_TOL
  # The lower-level path, which has no chance to untie, refuses instead of reading the embedding.
  cfg = hf.config_from_hf(hf.read_hf_config(folder))
  with pytest.raises(hf.HFError, match=r"tie_word_embeddings=true, but .* holds a lm_head\.weight that differs"):
    hf.from_hf_tensors(hf.open_hf_tensors(folder), cfg, hf.abstract_params(cfg))


def test_a_stored_head_equal_to_the_embedding_stays_tied(tmp_path):
  from safetensors.torch import load_file, save_file

  folder = save_tiny(tmp_path / "hf", "llama", {"tie_word_embeddings": True}, {})
  tensors = load_file(folder / "model.safetensors")
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
  save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
  model = mb.from_pretrained(folder, backend="linen")
  assert model.config.logits_via_embedding
  assert max_diff(model.logits(TOKENS), transformers_logits(folder)) <= LOGITS_TOL


def test_a_legacy_linear_rope_scaling_beside_rope_parameters_is_refused_by_name(saved_configs):
  """transformers reads rope_scaling in place of rope_parameters: linear scaling, which maxbridge does not implement."""
  config = {
      **saved_configs["llama"],
      "rope_parameters": {"rope_type": "default", "rope_theta": 5e5},
      "rope_scaling": {"type": "linear", "factor": 4},
  }
  with pytest.raises(hf.HFError, match=r"rope_scaling\.type='linear' is not supported \(transformers reads rope_scaling"):
    hf.config_from_hf(config)
  # An empty rope_scaling replaces nothing.
  config["rope_scaling"] = {}
  assert hf.config_from_hf(config).rope_max_timescale == 500000


def test_export_drops_aliases_that_would_override_what_it_writes(tmp_path):
  folder = save_tiny(tmp_path / "hf", "mixtral", {}, {"num_experts": 4})
  model = mb.from_pretrained(folder, backend="linen")
  written = hf.config_to_hf(model.config, hf.read_hf_config(folder))
  assert "num_experts" not in written and written["num_local_experts"] == 4
