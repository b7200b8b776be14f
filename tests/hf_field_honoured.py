"""The honoured fields' cases of `test_hf_fields`: a non-default value each, read as transformers reads it."""

from hf_field_cases import DELETE, Case

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
_DELTANET = (
    "linear_conv_kernel_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
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
    # first_k_dense_replace read where mlp_layer_types is absent; index_topk (4) below the case's 10 tokens;
    Case(
        "deepseek_v32",
        (
            *_SIZES,
            *("moe_intermediate_size", "n_shared_experts", "n_routed_experts", "routed_scaling_factor"),
            *("kv_lora_rank", "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group"),
            *("num_experts_per_tok", "first_k_dense_replace", "rope_parameters"),
            *("index_topk", "index_head_dim", "index_n_heads"),
        ),
        # YaRN with its cos/sin factor: the indexer's rotated halves are scaled as MLA's pairs are.
        build={
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 1e4,
                "factor": 4.0,
                "original_max_position_embeddings": 4,
            }
        },
        edit={"mlp_layer_types": DELETE},
        expect={"use_indexer": True, "indexer_topk": 4, "indexer_n_heads": 8, "rope_attention_scaling": True},
    ),
    # mlp_layer_types wins over first_k_dense_replace, as in transformers' model.
    Case(
        "deepseek_v32",
        ("mlp_layer_types", "tie_word_embeddings", "num_local_experts"),
        build={"tie_word_embeddings": True},
        edit={"first_k_dense_replace": 2, "n_routed_experts": 16, "num_local_experts": 8},
        expect={"first_num_dense_layers": 1},
    ),
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
    # The tower's sizes and token ids reach the config (tests/test_gemma3_vision.py runs them with images); the text
    # logits are transformers'. The top-level tie_word_embeddings ties lm_head, not text_config's.
    Case(
        "gemma3",
        (
            "text_config",
            "vision_config",
            "mm_tokens_per_image",
            "image_token_index",
            "boi_token_index",
            "eoi_token_index",
            "tie_word_embeddings",
        ),
        build={"tie_word_embeddings": False},
        expect={
            "use_multimodal": True,
            "vision_output_length": 1,
            "hidden_size_for_vit": 16,
            "image_size_for_vit": 8,
            "image_token_index": 63,
            "boi_token_index": 61,
            "eoi_token_index": 62,
            "logits_via_embedding": False,
            "num_decoder_layers": 6,
        },
    ),
    Case(
        "gemma3",
        ("image_token_id", "boi_token_id", "eoi_token_id"),
        edit={"image_token_id": 60, "boi_token_id": 58, "eoi_token_id": 59},
        expect={"image_token_index": 60, "boi_token_index": 58, "eoi_token_index": 59},
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
    # Qwen3.5: every size, the DeltaNet's among them, then RoPE, the tied head and a null layer_types.
    Case(
        "qwen3_5_text",
        (
            *_SIZES,
            "head_dim",
            "max_position_embeddings",
            *_DELTANET,
        ),
        expect={"num_experts": 1, "gdn_conv_kernel_dim": 3},
    ),
    Case(
        "qwen3_5_text",
        ("rope_parameters", "tie_word_embeddings", "layer_types"),
        build={"tie_word_embeddings": True},
        edit={
            "rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "partial_rotary_factor": 0.5},
            "layer_types": None,
        },
        expect={"partial_rotary_factor": 0.5, "rope_max_timescale": 500},
    ),
    Case(
        "qwen3_5_moe_text",
        (
            *(size for size in _SIZES if size != "intermediate_size"),
            "head_dim",
            "max_position_embeddings",
            "moe_intermediate_size",
            "shared_expert_intermediate_size",
            "num_experts",
            "num_experts_per_tok",
            *_DELTANET,
            "output_router_logits",
            "router_aux_loss_coef",
            "tie_word_embeddings",
            "layer_types",
        ),
        build={"tie_word_embeddings": True},
        edit={"output_router_logits": True, "router_aux_loss_coef": 0.25, "layer_types": None},
        expect={"shared_experts": 2, "norm_topk_prob": True, "load_balance_loss_weight": 0.25},
    ),
    Case(
        "qwen3_5_moe_text",
        ("rope_parameters",),
        edit={"rope_parameters": {"rope_type": "default", "rope_theta": 500.0, "mrope_section": [1, 1, 0]}},
        expect={"partial_rotary_factor": 0.25, "rope_max_timescale": 500},
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
            "use_double_wide_mlp",
        ),
        build={
            "num_hidden_layers": 12,
            "num_kv_shared_layers": 6,
            "use_double_wide_mlp": True,
            "attention_k_eq_v": True,
            "global_head_dim": 24,
            "num_global_key_value_heads": 1,
            "rope_parameters": _GEMMA4_ROPE,
            "max_position_embeddings": 6,
            "tie_word_embeddings": False,
        },
        expect={
            "global_head_dim": 24,
            "global_num_kv_heads": 1,
            "global_rope_proportion": 0.5,
            "use_double_wide_mlp": True,
        },
    ),
    Case(
        "gemma4_text",
        ("enable_moe_block", "num_experts", "top_k_experts", "moe_intermediate_size"),
        build={"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 8},
        expect={"num_experts": 4, "num_experts_per_tok": 2, "moe_mlp_dim": 8},
    ),
]
