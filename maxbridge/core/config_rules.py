"""What a Config must satisfy (which keys it may hold, MaxText's among them: `config_keys`).

maxbridge.config reads and coerces the values; the rules live here, apart, so
each reads as a table or a plain function of one Config. Pure Python (no jax),
like maxbridge.config, so the CLI rejects a bad key before JAX starts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

from maxbridge.core import array_limits, families, posttrain_rules
from maxbridge.core.posttrain_rules import (
    GRPO_ADVANTAGE_STD,
    GRPO_IMPORTANCE_SAMPLING_LEVELS,
    GRPO_KL_ESTIMATORS,
    GRPO_LOSS_AGG_MODES,
    GRPO_SCALE_REWARDS,
    PREFERENCE_KEYS,
)
from maxbridge.core.pipeline_plan import pipeline_plan

# `maxbridge.core.config.Config`, which runs these rules on every instance: so this module cannot import it.
Config = Any

# Each mesh axis's size, in the order of config.MESH_AXES (diloco, data, stage, fsdp, context, tensor, expert).
ICI_PARALLELISM_KEYS = tuple(
    f"ici_{axis}_parallelism" for axis in ("diloco", "data", "pipeline", "fsdp", "context", "tensor", "expert")
)
# Pallas splash attention's block sizes (`ops.splash_attention.Blocks`), each a multiple of a TPU's 128 lanes; a
# compute block steps through the block of keys it names, so divides it.
SPLASH_BLOCKS = ("q", "kv", "kv_compute", "q_dkv", "kv_dkv", "kv_dkv_compute", "q_dq", "kv_dq")
SPLASH_COMPUTE_BLOCKS = {"kv_compute": "kv", "kv_dkv_compute": "kv_dkv"}


class ConfigError(ValueError):
  """A configuration key or value that cannot be used; the message says which and why."""


# MaxText's `quantization` values ("" = float). Each library accepts a subset.
QUANTIZATIONS = ("", "int8", "int4", "fp8", "nf4")
QUANTIZATIONS_BY_LIBRARY = {"aqt": ("", "int8"), "qwix": ("", "int8", "int4", "fp8")}


def _raise(problem: str | None) -> None:
  if problem is not None:
    raise ConfigError(problem)


def _positive(value: float) -> bool:
  return value > 0


# Each rule: key, test the value must pass, and what a valid value is.
_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
    *((f"sa_block_{b}", lambda v: v > 0 and v % 128 == 0, "a positive multiple of 128") for b in SPLASH_BLOCKS),
    *(
        (key, _positive, "a positive integer")
        for key in (
            "base_emb_dim",
            "base_num_query_heads",
            "base_num_kv_heads",
            "head_dim",
            "base_mlp_dim",
            "base_num_decoder_layers",
            "vocab_size",
            "max_target_length",
            "rope_max_timescale",
            "original_max_position_embeddings",
            "steps",
            "per_device_batch_size",
            "eval_steps",
            "checkpoint_period",
            "max_to_keep",
            "log_period",
            "gradient_accumulation_steps",
        )
    ),
    *(
        (key, lambda v: v == -1 or v > 0, "a positive integer, or -1 for the remaining devices")
        for key in ICI_PARALLELISM_KEYS
    ),
    *(
        (key, lambda v: v == -1 or v > 0, "a positive integer, or -1 for the remaining processes")
        for key in ("dcn_diloco_parallelism", "dcn_data_parallelism", "dcn_fsdp_parallelism")
    ),
    ("dcn_pipeline_parallelism", _positive, "a positive integer (the pipeline stages count it: never -1)"),
    ("num_layers_per_pipeline_stage", _positive, "a positive integer"),
    *(
        (key, lambda v: v == -1 or v > 0, "a positive integer, or -1 (derived)")
        for key in ("num_pipeline_repeats", "num_pipeline_microbatches", "pipeline_parallel_layers")
    ),
    ("num_processes", _positive, "a positive integer"),
    ("compile_topology_num_slices", _positive, "a positive integer"),
    ("process_id", lambda v: v >= 0, ">= 0"),
    # numpy's generators and Grain's shuffles take no negative seed; 32 bits as MaxText's seeds.
    ("seed", lambda v: 0 <= v < 2**32, "an integer in [0, 2**32)"),
    (
        "learning_rate_schedule_steps",
        lambda v: v == -1 or v > 0,
        "a positive integer (the steps the schedule spans), or -1 for steps",
    ),
    *(
        (key, _positive, "a positive integer")
        for key in (
            "num_experts",
            "num_experts_per_tok",
            "moe_mlp_dim",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "gdn_num_key_heads",
            "gdn_num_value_heads",
            "gdn_key_head_dim",
            "gdn_value_head_dim",
            "gdn_conv_kernel_dim",
            "gdn_chunk_size",
        )
    ),
    ("partial_rotary_factor", lambda v: 0 < v <= 1, "in (0, 1] (the fraction of each head's dims that RoPE turns)"),
    *(
        (key, lambda v: v >= 0, ">= 0 (0 disables it)")
        for key in ("sliding_window_size", "trainable_position_size", "q_lora_rank", "shared_experts")
    ),
    *(
        (key, lambda v: 0 <= v < float("inf"), "a finite number >= 0 (0 disables it)")
        for key in ("attn_logits_soft_cap", "final_logits_soft_cap", "query_pre_attn_scalar")
    ),
    *(
        (key, lambda v: v == -1 or v > 0, "a positive integer, or -1 for no group-limited routing")
        for key in ("n_routing_groups", "topk_routing_group")
    ),
    ("first_num_dense_layers", lambda v: v >= 0, ">= 0"),
    ("chunk_attn_window_size", lambda v: v >= 0, ">= 0 (0 disables it)"),
    ("nope_layer_interval", lambda v: v == -1 or v > 0, "a positive integer, or -1 for no NoPE layers"),
    ("interleave_moe_layer_step", _positive, "a positive integer"),
    ("temperature_tuning_scale", lambda v: 0 <= v < float("inf"), "a finite number >= 0"),
    ("temperature_tuning_floor_scale", _positive, "> 0"),
    *(
        (key, lambda v: v >= 0, ">= 0 (0: as the sliding-window layers, or off)")
        for key in ("global_head_dim", "global_num_kv_heads", "hidden_size_per_layer_input", "num_kv_shared_layers")
    ),
    ("global_rope_proportion", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("load_balance_loss_weight", lambda v: v >= 0, ">= 0 (0 disables the loss)"),
    ("routed_scaling_factor", _positive, "> 0"),
    ("rope_factor", lambda v: v >= 1, ">= 1 (how many times slower the longest wavelengths turn)"),
    ("beta_fast", lambda v: 0 < v < float("inf"), "a finite number > 0 (yarn: rotations)"),
    ("beta_slow", lambda v: 0 < v < float("inf"), "a finite number > 0 (yarn: rotations)"),
    ("mscale", lambda v: 0 <= v < float("inf"), "a finite number >= 0 (deepseek yarn; 0: no softmax rescaling)"),
    ("mlp_activations_limit", lambda v: 0 <= v < float("inf"), "a finite number >= 0 (0: no clamp)"),
    ("rope_low_freq_factor", _positive, "> 0"),
    ("local_rope_max_timescale", lambda v: v == -1 or v > 0, "a positive integer, or -1 for rope_max_timescale"),
    ("rope_linear_scaling_factor", _positive, "> 0 (1 leaves RoPE unscaled)"),
    ("normalization_layer_epsilon", _positive, "> 0"),
    ("adam_eps", _positive, "> 0"),
    ("learning_rate", lambda v: v >= 0, ">= 0"),
    ("adam_weight_decay", lambda v: v >= 0, ">= 0"),
    ("gradient_clipping_threshold", lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    ("z_loss_multiplier", lambda v: v >= 0, ">= 0"),
    ("num_vocab_tiling", _positive, "a positive integer (1 disables tiling)"),
    ("mtp_num_layers", lambda v: v >= 0, "an integer >= 0 (0 disables multi-token prediction)"),
    ("mtp_loss_scaling_factor", lambda v: 0 <= v < float("inf"), "a finite number >= 0"),
    ("mtp_eval_target_module", lambda v: v >= 0, "an integer >= 0 (0: none)"),
    ("speculative_mtp_tokens", lambda v: v >= 0, "an integer >= 0 (0: no speculative decoding)"),
    ("dpo_beta", _positive, "> 0"),
    ("dpo_label_smoothing", lambda v: 0 <= v <= 0.5, "in [0, 0.5] (0 is plain DPO)"),
    ("orpo_lambda", lambda v: 0 <= v < float("inf"), "a finite number >= 0 (0 is plain SFT on the chosen side)"),
    ("simpo_beta", _positive, "> 0"),
    ("simpo_gamma", lambda v: 0 <= v < float("inf"), "a finite number >= 0 (the target reward margin)"),
    ("simpo_label_smoothing", lambda v: 0 <= v <= 0.5, "in [0, 0.5] (0 is plain SimPO)"),
    ("kto_beta", _positive, "> 0"),
    ("kto_desirable_weight", _positive, "> 0"),
    ("kto_undesirable_weight", _positive, "> 0"),
    ("num_generations", lambda v: v >= 2, ">= 2 (GRPO's advantages compare the completions of one prompt)"),
    ("grpo_beta", lambda v: v >= 0, ">= 0 (0 drops the KL penalty)"),
    ("grpo_epsilon", lambda v: 0 < v < 1, "in (0, 1) (the policy ratio is clipped to [1 - epsilon, 1 + epsilon])"),
    ("num_iterations", lambda v: v >= 1, ">= 1 (updates per sampled batch)"),
    ("epsilon_high", lambda v: v == -1 or v > 0, "> 0 (ratio <= 1 + epsilon_high), or -1 for grpo_epsilon"),
    ("max_num_gen_batches", lambda v: v >= 1, ">= 1 (batches sampled per step at most with dynamic_sampling)"),
    ("overlong_buffer_length", lambda v: v >= 0, ">= 0 (0 turns overlong shaping off)"),
    ("overlong_penalty_factor", lambda v: v >= 0, ">= 0"),
    ("off_policy_steps", lambda v: v >= 0, ">= 0 (policy versions a rollout may lag the learner; 0 is synchronous)"),
    ("max_concurrency", lambda v: v >= 1, ">= 1 (the rollout engine's slots)"),
    ("max_turns", lambda v: v >= 1, ">= 1 (model turns per episode)"),
    ("max_turn_tokens", lambda v: v >= 1, ">= 1 (tokens per model turn)"),
    ("qk_clip_threshold", lambda v: 0 < v < float("inf"), "a finite number > 0"),
    (
        "quantization_local_shard_count",
        lambda v: v >= -1,
        "-1 (one shard per slice), 0 (float weight gradients) or a positive shard count",
    ),
    ("eval_interval", lambda v: v >= 0, ">= 0 (0 disables evaluation)"),
    ("grain_worker_count", lambda v: v >= 0, ">= 0 (0 reads in the training process)"),
    ("grain_shuffle_buffer_size", lambda v: v >= 0, ">= 0 (0 shuffles globally)"),
    ("lora_rank", lambda v: v >= 0, ">= 0 (0 disables LoRA)"),
    ("lora_alpha", _positive, "> 0 (adapters are scaled by lora_alpha / lora_rank)"),
    ("lora_dropout", lambda v: 0 <= v < 1, "in [0, 1) (the probability of dropping an adapter input feature)"),
    ("warmup_steps_fraction", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("cosine_learning_rate_final_fraction", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("adam_b1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("adam_b2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("muon_beta", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("distill_alpha", lambda v: 0 <= v <= 1, "in [0, 1] (0: cross-entropy only, 1: the teacher's KL only)"),
    ("distill_temperature", _positive, "> 0"),
    ("distill_beta", lambda v: v >= 0, ">= 0 (0: no feature loss)"),
    ("diloco_sync_period", _positive, "a positive integer (inner steps between outer steps)"),
    ("diloco_outer_lr", _positive, "> 0"),
    ("diloco_outer_momentum", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("muon_weight_decay", lambda v: v >= 0, ">= 0"),
    ("muon_consistent_rms", lambda v: v >= 0, ">= 0 (0: width scaling, MaxText's null)"),
    ("max_prefill_predict_length", _positive, "a positive integer"),
    ("decode_sampling_temperature", lambda v: 0 <= v < float("inf"), ">= 0 (0 is greedy)"),
    ("decode_sampling_top_k", lambda v: v >= 0, ">= 0"),
    ("decode_sampling_nucleus_p", lambda v: v == -1 or 0 < v <= 1, "in (0, 1], or -1 when unused"),
)

# MaxText's `attention` values that name a kernel we have (`ops.attention.choose_kernel`); its others
# (cudnn_flash_te, paged, ...) are refused by name until their kernels land. "flash" is splash attention on a TPU,
# cuDNN's on a GPU and the blockwise kernel on a CPU: O(T x block) memory instead of the [T, S] scores.
ATTENTION_KERNELS = ("autoselected", "dot_product", "flash")

_CHOICES: dict[str, tuple[Any, ...]] = {
    "decoder_block": families.DECODER_BLOCKS,
    "routed_score_func": ("", "softmax", "sigmoid"),
    "rope_type": ("default", "llama3.1", "yarn"),
    "dtype": ("float32", "bfloat16"),
    "weight_dtype": ("float32", "bfloat16"),
    "remat_policy": ("none", "full", "minimal", "minimal_offloaded"),
    "attention": ATTENTION_KERNELS,
    **{f"sa_{x}_layout": ("HEAD_DIM_MINOR", "SEQ_MINOR") for x in "qkv"},
    "param_scan_axis": (0, 1),
    "dataset_type": ("embedded", "synthetic", "text", "sft", "grain"),
    "grain_file_type": ("auto", "jsonl", "text", "parquet", "arrayrecord", "arrow"),
    "decode_sampling_strategy": ("greedy", "weighted", "topk", "nucleus"),
    "kv_quant_dtype": ("int8",),
    "quantization": QUANTIZATIONS,
    "lora_weight_qtype": ("", "int8", "nf4"),
    "opt_type": ("adamw", "muon"),
    "distill_feature_loss_type": ("cosine", "l2"),
    "context_parallel_strategy": ("all_gather", "ring"),
    "grpo_kl_estimator": GRPO_KL_ESTIMATORS,
    "importance_sampling_level": GRPO_IMPORTANCE_SAMPLING_LEVELS,
    "loss_agg_mode": GRPO_LOSS_AGG_MODES,
    "scale_rewards": GRPO_SCALE_REWARDS,
    "grpo_advantage_std": GRPO_ADVANTAGE_STD,
}


def validate(config: Config) -> None:
  """Raise ConfigError naming the first rule `cfg` breaks; Config runs this on every instance."""
  for field in dataclasses.fields(config):
    value = getattr(config, field.name)
    # Config coerces before it validates, so exactly its float keys hold floats here.
    if isinstance(value, float) and not math.isfinite(value):
      raise ConfigError(f"config key {field.name!r} = {value!r} is invalid; it must be a finite number")
  for key, ok, valid in _RULES:
    value = getattr(config, key)
    if not ok(value):  # written as "not ok" so NaN fails too
      raise ConfigError(f"config key {key!r} = {value!r} is invalid; it must be {valid}")
  for key, choices in _CHOICES.items():
    value = getattr(config, key)
    if value not in choices:
      listed = ", ".join(repr(c) for c in choices)
      raise ConfigError(f"config key {key!r} = {value!r} is invalid; valid values: {listed}")
  for compute, block in SPLASH_COMPUTE_BLOCKS.items():
    if getattr(config, f"sa_block_{block}") % getattr(config, f"sa_block_{compute}"):
      raise ConfigError(
          f"sa_block_{compute}={getattr(config, f'sa_block_{compute}')} must divide sa_block_{block}="
          f"{getattr(config, f'sa_block_{block}')}: splash attention steps through each block of keys in it"
      )
  if config.base_num_query_heads % config.base_num_kv_heads:
    raise ConfigError(
        f"base_num_query_heads={config.base_num_query_heads} must be a multiple of "
        f"base_num_kv_heads={config.base_num_kv_heads}: each kv head serves an equal group of query heads"
    )
  if config.max_target_length < 2:
    # One token has no next token to predict: every loss would be over zero targets.
    raise ConfigError(
        f"max_target_length={config.max_target_length} is too short to train on; it must be >= 2 "
        "(each token predicts the next)"
    )
  if config.mtp_num_layers > config.max_target_length - 2:
    # Module k predicts the token k + 1 ahead of each position: past this every position of a module is masked,
    # and its layers (each one more to compile) train on nothing.
    raise ConfigError(
        f"mtp_num_layers={config.mtp_num_layers} exceeds max_target_length - 2 = {config.max_target_length - 2}: "
        f"module k predicts the token k + 1 ahead, so a module past that has no target in a "
        f"{config.max_target_length}-token sequence; lower mtp_num_layers"
    )
  if config.trainable_position_size and config.max_target_length > config.trainable_position_size:
    raise ConfigError(
        f"max_target_length={config.max_target_length} exceeds trainable_position_size="
        f"{config.trainable_position_size}: the learned position table has no row for positions past "
        f"{config.trainable_position_size - 1}; lower max_target_length or raise trainable_position_size"
    )
  if config.load_parameters_path and config.load_full_state_path:
    raise ConfigError(
        "load_parameters_path and load_full_state_path are both set: a new run starts from one checkpoint; "
        "set load_parameters_path for its parameters only, or load_full_state_path for parameters, "
        "optimizer state and step"
    )
  if config.process_id >= config.num_processes:
    raise ConfigError(f"process_id={config.process_id} must be below num_processes={config.num_processes}")
  array_limits.check_length(config, config.per_device_batch_size, ConfigError, " (per_device_batch_size)")
  _validate_family(config)
  _validate_pipeline(config)
  _validate_context(config)
  _validate_sampling(config)
  _validate_quantization(config)
  _raise(posttrain_rules.lora_problem(config))
  _validate_mtp(config)
  _validate_diloco(config)
  _raise(posttrain_rules.feature_distillation_problem(config))
  if config.dataset_type == "text" and not config.dataset_path:
    raise ConfigError("dataset_type='text' needs dataset_path (a text file to train on)")
  if config.dataset_type == "grain" and not config.grain_train_files:
    raise ConfigError("dataset_type='grain' needs grain_train_files (a file, folder or glob of training files)")
  _raise(posttrain_rules.preference_problem(config))
  if config.use_sft and config.dataset_type != "grain":
    raise ConfigError(
        f"use_sft=true reads SFT rows through Grain: set dataset_type='grain' (or dataset_type='sft' without "
        f"use_sft for the in-memory path), got dataset_type={config.dataset_type!r}"
    )
  _raise(posttrain_rules.grpo_problem(config))


def _validate_pipeline(config: Config) -> None:
  """The pipeline's layers and micro-batches divide (`pipeline_plan`), and what it cannot run is refused."""
  try:
    plan = pipeline_plan(config)
  except ValueError as error:
    raise ConfigError(str(error)) from None
  if plan is None:
    return
  if not config.scan_layers:
    raise ConfigError(
        f"ici_pipeline_parallelism={config.ici_pipeline_parallelism} needs scan_layers=true: a pipeline splits the "
        "stacked layers of a scanned stack into stages"
    )
  if config.use_qwix_quantization:
    raise ConfigError(
        f"ici_pipeline_parallelism={config.ici_pipeline_parallelism} with use_qwix_quantization=true: Qwix intercepts "
        "the decoder's layers, which a pipeline runs as pure functions; use AQT (use_qwix_quantization=false)"
    )


def _validate_context(config: Config) -> None:
  """Context parallelism as maxbridge computes it (`maxbridge.ops.attention`: keys and values gathered)."""
  if config.context_parallel_strategy == "ring":
    raise ConfigError(
        "context_parallel_strategy='ring' (ring attention) is not implemented: maxbridge gathers keys and values "
        "over the context axis; set context_parallel_strategy='all_gather'"
    )
  if config.ici_context_parallelism > 1 and config.max_target_length % config.ici_context_parallelism:
    raise ConfigError(
        f"ici_context_parallelism={config.ici_context_parallelism} splits each sequence into that many equal pieces: "
        f"max_target_length={config.max_target_length} must be a multiple of it"
    )


def _validate_sampling(config: Config) -> None:
  """A `decode_sampling_*` value the chosen strategy would read and cannot use is refused, not decoded greedily."""
  strategy = config.decode_sampling_strategy
  if strategy != "greedy" and config.decode_sampling_temperature == 0:
    raise ConfigError(
        f"decode_sampling_strategy={strategy!r} divides the logits by decode_sampling_temperature, which is 0: "
        "set a temperature > 0, or decode_sampling_strategy='greedy'"
    )
  if strategy == "topk" and not 1 <= config.decode_sampling_top_k <= config.vocab_size:
    raise ConfigError(
        f"decode_sampling_strategy='topk' samples among the decode_sampling_top_k most likely tokens: it must be "
        f"in [1, vocab_size={config.vocab_size}], got {config.decode_sampling_top_k}"
    )
  if strategy == "nucleus" and config.decode_sampling_nucleus_p == -1:
    raise ConfigError(
        "decode_sampling_strategy='nucleus' samples among the most likely tokens holding decode_sampling_nucleus_p "
        "of the probability: set it in (0, 1]"
    )


def _validate_mtp(config: Config) -> None:
  """Multi-token prediction runs where its logits reach a cross-entropy loss, on a family of single layers."""
  if config.speculative_mtp_tokens > config.mtp_num_layers:
    raise ConfigError(
        f"speculative_mtp_tokens={config.speculative_mtp_tokens} drafts one token per MTP module, and "
        f"mtp_num_layers={config.mtp_num_layers}: set it to at most {config.mtp_num_layers}"
    )
  if config.mtp_eval_target_module > config.mtp_num_layers:
    raise ConfigError(
        f"mtp_eval_target_module={config.mtp_eval_target_module} names no module: it must be in "
        f"1..mtp_num_layers={config.mtp_num_layers}, or 0 for none"
    )
  if not config.mtp_num_layers:
    return
  stack = families.lookup(config.decoder_block).mtp_stack(config)
  if stack.sublayers:
    raise ConfigError(
        f"mtp_num_layers={config.mtp_num_layers}: decoder_block={config.decoder_block!r} stacks blocks of "
        f"{len(stack.sublayers)} layers ({', '.join(stack.sublayers)}), and an MTP module holds one decoder layer; "
        "set mtp_num_layers=0"
    )
  plain_loss = "the MTP loss is added to the plain cross-entropy over full logits only"
  refused = (
      ("num_vocab_tiling > 1", config.num_vocab_tiling > 1, plain_loss),
      *((f"{key}=true", getattr(config, key), plain_loss) for key in PREFERENCE_KEYS),
      ("use_grpo=true", config.use_grpo, plain_loss),
      ("distillation (teacher_overrides)", bool(config.teacher_overrides or config.distill_logits_path), plain_loss),
      ("use_qk_clip=true", config.use_qk_clip, "QK-Clip does not rescale the MTP modules' attention"),
  )
  for what, on, why in refused:
    if on:
      raise ConfigError(
          f"mtp_num_layers={config.mtp_num_layers} with {what}: {why}; set mtp_num_layers=0 or turn the other off"
      )


def _validate_diloco(config: Config) -> None:
  """DiLoCo (`maxbridge.training.diloco`) on the "diloco" mesh axis, with what it cannot combine with refused."""
  replicas = (config.ici_diloco_parallelism, config.dcn_diloco_parallelism)
  if not config.enable_diloco:
    if replicas != (1, 1):
      raise ConfigError(
          f"ici_diloco_parallelism={replicas[0]}, dcn_diloco_parallelism={replicas[1]} split the devices into DiLoCo "
          "replicas, which only DiLoCo trains (each on its own share of the batch): set enable_diloco=true, or "
          "leave both at 1"
      )
    return
  why = "each DiLoCo replica runs the plain train step on its own copy of the state"
  refused = (
      ("ici_pipeline_parallelism > 1", config.ici_pipeline_parallelism > 1 or config.dcn_pipeline_parallelism > 1, why),
      ("shard_optimizer_over_data=true (ZeRO-1)", config.shard_optimizer_over_data, why),
      ("use_dpo=true", config.use_dpo, "DPO's frozen reference is one model, not one per replica"),
      ("use_kto=true", config.use_kto, "KTO's frozen reference is one model, not one per replica"),
      ("use_grpo=true", config.use_grpo, "GRPO samples its batches from one policy, not one per replica"),
      ("lora_rank > 0", config.lora_rank > 0, "the frozen base would be held once per replica"),
      ("load_full_state_path", bool(config.load_full_state_path), "a plain run's state has no per-replica states"),
  )
  for what, on, reason in refused:
    if on:
      raise ConfigError(f"enable_diloco=true with {what}: {reason}; turn one of them off")
  if -1 in replicas:
    raise ConfigError(
        f"enable_diloco=true: ici_diloco_parallelism={replicas[0]} and dcn_diloco_parallelism={replicas[1]} set the "
        "replica count, so neither may be -1"
    )


def _validate_family(config: Config) -> None:
  """Cross-key rules of the model: those every family shares, then the family's own (its entry's `check`)."""
  if config.use_qk_clip and config.use_qk_norm:
    raise ConfigError(
        "use_qk_clip=true with use_qk_norm=true: the query/key RMSNorm undoes any scaling of the "
        "query kernel, and already bounds the logits; set use_qk_clip=false"
    )
  if config.use_qk_clip and config.attn_logits_soft_cap:
    raise ConfigError(
        f"use_qk_clip=true with attn_logits_soft_cap={config.attn_logits_soft_cap}: the soft-cap already bounds "
        "every attention logit below it, so QK-Clip's max-logit threshold measures the cap, not the weights; "
        "set use_qk_clip=false"
    )
  if config.rope_high_freq_factor < config.rope_low_freq_factor:
    raise ConfigError(
        f"rope_high_freq_factor={config.rope_high_freq_factor} must be at least rope_low_freq_factor="
        f"{config.rope_low_freq_factor}: they bound the band of wavelengths that blends scaled and unscaled"
    )
  family = families.lookup(config.decoder_block)
  if not family.layer_rope and (config.local_rope_max_timescale != -1 or config.rope_linear_scaling_factor != 1.0):
    raise ConfigError(
        f"local_rope_max_timescale={config.local_rope_max_timescale} and rope_linear_scaling_factor="
        f"{config.rope_linear_scaling_factor} give local and global layers their own RoPE (decoder_block='gemma3'); "
        f"decoder_block={config.decoder_block!r} rotates every layer alike: leave them at -1 and 1.0"
    )
  for other in families.REGISTRY:
    for key, unused in other.own_keys.items():
      if key not in family.own_keys and getattr(config, key) != unused:
        readers = " and ".join(repr(f.decoder_blocks[0]) for f in families.REGISTRY if key in f.own_keys)
        raise ConfigError(
            f"{key}={getattr(config, key)!r} is read by decoder_block={readers} only; "
            f"decoder_block={config.decoder_block!r} does not: leave it at {unused!r}"
        )
  if config.num_experts_per_tok > config.num_experts:
    raise ConfigError(
        f"num_experts_per_tok={config.num_experts_per_tok} must be at most num_experts={config.num_experts}"
    )
  _check_multimodal(config, family)
  problems = families.lookup(config.decoder_block).check(config)
  if problems:
    raise ConfigError("\n".join(problems))


def _check_multimodal(config, family) -> None:
  if not config.use_multimodal:
    return
  if family.vision_tower is None:
    towers = ", ".join(repr(f.decoder_blocks[0]) for f in families.REGISTRY if f.vision_tower)
    raise ConfigError(
        f"use_multimodal=true: decoder_block={config.decoder_block!r} has no vision tower in maxbridge "
        f"(decoder blocks with one: {towers}); set use_multimodal=false"
    )
  for key in (
      "image_size_for_vit",
      "num_channels_for_vit",
      "patch_size_for_vit",
      "hidden_size_for_vit",
      "intermediate_size_for_vit",
      "num_hidden_layers_for_vit",
      "num_attention_heads_for_vit",
      "vision_output_length",
  ):
    if getattr(config, key) <= 0:
      raise ConfigError(f"config key {key!r} = {getattr(config, key)!r} is invalid; it must be a positive integer")
  if config.normalization_layer_epsilon_for_vit <= 0:
    raise ConfigError("config key 'normalization_layer_epsilon_for_vit' must be > 0")
  if config.conv_stride_for_vit != config.patch_size_for_vit:
    raise ConfigError(
        f"conv_stride_for_vit={config.conv_stride_for_vit} must equal patch_size_for_vit={config.patch_size_for_vit}: "
        "the tower embeds non-overlapping patches"
    )
  if config.image_size_for_vit % config.patch_size_for_vit:
    raise ConfigError(
        f"image_size_for_vit={config.image_size_for_vit} must be a multiple of patch_size_for_vit={config.patch_size_for_vit}"
    )
  if config.hidden_size_for_vit % config.num_attention_heads_for_vit:
    raise ConfigError(
        f"hidden_size_for_vit={config.hidden_size_for_vit} must be a multiple of num_attention_heads_for_vit="
        f"{config.num_attention_heads_for_vit}"
    )
  grid, side = config.image_size_for_vit // config.patch_size_for_vit, math.isqrt(config.vision_output_length)
  if side * side != config.vision_output_length or grid % side:
    raise ConfigError(
        f"vision_output_length={config.vision_output_length} must be a square whose side divides the "
        f"{grid}x{grid} patch grid (image_size_for_vit / patch_size_for_vit): the projector pools square windows"
    )
  if config.attention not in ("dot_product", "autoselected"):
    raise ConfigError(
        f"attention={config.attention!r} with use_multimodal=true: image tokens attend both ways within their "
        "image, which the dot_product kernel's mask reads; set attention=dot_product or autoselected"
    )


def _validate_quantization(config: Config) -> None:
  library = "qwix" if config.use_qwix_quantization else "aqt"
  supported = QUANTIZATIONS_BY_LIBRARY[library]
  if config.quantization not in supported:
    listed = ", ".join(repr(c) for c in supported)
    raise ConfigError(
        f"config key 'quantization' = {config.quantization!r} is not supported with use_qwix_quantization="
        f"{str(config.use_qwix_quantization).lower()} ({library}); valid values: {listed}"
    )
  if config.checkpoint_is_quantized and not config.quantization:
    raise ConfigError(
        "checkpoint_is_quantized=true needs the quantization its weights were made with: set quantization "
        f"(one of {', '.join(repr(c) for c in supported if c)})"
    )
