"""The tiny transformers configs of every family and the refused fields' cases (`test_hf_fields`)."""

import dataclasses

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
_QWEN3_5 = {
    **DIMS,
    "num_hidden_layers": 4,
    "head_dim": 8,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 4,
    "linear_value_head_dim": 6,
    "linear_conv_kernel_dim": 3,
}
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
    # DeepSeek-V3's tiny sizes with an indexer that keeps 4 of a case's 10 tokens' keys.
    "deepseek_v32": (
        "DeepseekV32Config",
        "DeepseekV32ForCausalLM",
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
            index_topk=4,
            index_n_heads=8,
            index_head_dim=8,
            rms_norm_eps=1e-3,
            initializer_range=0.1,
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
    # gemma3_text's language model under a 2-block SigLIP over 8x8 images of 4x4 patches, one soft token each.
    "gemma3": (
        "Gemma3Config",
        "Gemma3ForConditionalGeneration",
        {
            "text_config": {
                **DIMS,
                "num_hidden_layers": 6,
                "head_dim": 16,
                "sliding_window": 3,
                "query_pre_attn_scalar": 12,
            },
            "vision_config": {
                "hidden_size": 16,
                "intermediate_size": 24,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "image_size": 8,
                "patch_size": 4,
                "layer_norm_eps": 1e-3,
            },
            "mm_tokens_per_image": 1,
            "boi_token_index": 61,
            "eoi_token_index": 62,
            "image_token_index": 63,
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
    # Qwen3-Next's block, its DeltaNet inputs stored apart; dense, then with routed and shared experts.
    "qwen3_5_text": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", {**_QWEN3_5}),
    "qwen3_5_moe_text": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        {
            **{key: value for key, value in _QWEN3_5.items() if key != "intermediate_size"},
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "num_experts": 4,
            "num_experts_per_tok": 3,
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
    ("deepseek_v32", "hidden_act", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("deepseek_v32", "norm_topk_prob", {"norm_topk_prob": False}, "norm_topk_prob=False"),
    ("deepseek_v32", "attention_bias", {"attention_bias": True}, "attention_bias=True"),
    ("deepseek_v32", "q_lora_rank", {"q_lora_rank": None}, "q_lora_rank=None"),
    ("deepseek_v32", "scoring_func", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v32", "topk_method", {"topk_method": "greedy"}, "topk_method='greedy'"),
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
    *(
        (family, field, {field: value}, match)
        for family in ("qwen3_5_text", "qwen3_5_moe_text")
        for field, value, match in (
            ("hidden_act", "gelu", "hidden_act='gelu'"),
            ("attention_bias", True, "attention_bias=True"),
            ("layer_types", ["full_attention"] * 4, r"layer_types=\['full_attention'"),
        )
    ),
    (
        "qwen3_5_moe_text",
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
