"""What a fine-tuning or post-training run's config must satisfy: one objective at a time, each on the data it
reads (the preference losses and GRPO), LoRA's adapters and feature distillation. Each rule returns what is wrong, or None; `config_rules.validate` raises it as a
ConfigError. Pure Python, as config_rules.
"""

from __future__ import annotations

import re
from typing import Any

from maxbridge.core import families

Config = Any

# The preference losses' keys, in the order a run names the one it trains with (`Config.preference_loss`).
PREFERENCE_KEYS = ("use_dpo", "use_orpo", "use_simpo", "use_kto")
# GRPO's built-in verifiable rewards for the built-in arithmetic prompts (maxbridge/posttrain/grpo.py).
GRPO_REWARDS = ("arithmetic", "exact_match", "format")
# GRPO's variants' choices (training/posttrain/grpo_objectives.py reads them): TRL's scale_rewards and
# importance_sampling_level, verl's and Tunix's loss_agg_mode, Schulman's KL estimators.
GRPO_SCALE_REWARDS = ("group", "batch", "none")
GRPO_ADVANTAGE_STD = ("population", "sample")
GRPO_KL_ESTIMATORS = ("k1", "k2", "k3")
GRPO_IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence", "sequence_token")
GRPO_LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def preference_problem(config: Config) -> str | None:
  """One objective at a time among the preference losses and GRPO, each on the data it reads."""
  on = [key for key in ("use_grpo", *PREFERENCE_KEYS) if getattr(config, key)]
  if len(on) > 1:
    return (
        f"{' and '.join(f'{key}=true' for key in on)}: a run trains one objective; keep one of them and set the "
        "others to false"
    )
  key = next((key for key in PREFERENCE_KEYS if getattr(config, key)), None)
  if key is None:
    return None
  if config.dataset_type not in ("embedded", "sft", "grain"):
    what, fields = (
        ("unpaired rows", "prompt/completion/label")
        if key == "use_kto"
        else ("preference pairs", "prompt/chosen/rejected")
    )
    return (
        f"{key}=true reads {what}: dataset_type must be 'sft' ({fields} .jsonl rows "
        f"in dataset_path), 'grain' (such rows in grain_train_files) or 'embedded' (the built-in set), "
        f"got {config.dataset_type!r}"
    )
  if config.use_sft:
    return f"use_sft=true and {key}=true: rows are SFT examples or preference rows; set one to false"
  if config.num_vocab_tiling > 1:
    return f"{key}=true computes full logits for its log-probabilities; set num_vocab_tiling=1"
  return None


def grpo_problem(config: Config) -> str | None:
  if config.reward_function not in GRPO_REWARDS and not re.fullmatch(
      r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+", config.reward_function
  ):
    listed = ", ".join(repr(r) for r in GRPO_REWARDS)
    return (
        f"config key 'reward_function' = {config.reward_function!r} is invalid; valid values: {listed}, "
        "or the dotted path of a Python callable (package.module.function)"
    )
  if not config.use_grpo:
    return None
  if config.dataset_type != "embedded":
    return (
        f"use_grpo=true samples completions of the built-in arithmetic prompts: dataset_type must be 'embedded', "
        f"got {config.dataset_type!r}"
    )
  if config.max_target_length <= config.max_prefill_predict_length:
    return (
        f"use_grpo=true samples max_target_length - max_prefill_predict_length tokens per completion: "
        f"max_target_length={config.max_target_length} must exceed max_prefill_predict_length="
        f"{config.max_prefill_predict_length}"
    )
  if config.num_vocab_tiling > 1:
    return "use_grpo=true computes full logits for its log-probabilities; set num_vocab_tiling=1"
  if config.num_processes > 1:
    return f"use_grpo=true samples in one process: num_processes={config.num_processes} must be 1"
  new_tokens = config.max_target_length - config.max_prefill_predict_length
  if config.overlong_buffer_length > new_tokens:
    return (
        f"overlong_buffer_length={config.overlong_buffer_length} exceeds the longest completion sampled "
        f"(max_target_length - max_prefill_predict_length = {new_tokens}): set it in [0, {new_tokens}]"
    )
  if config.num_iterations > 1 and config.enable_checkpointing and config.checkpoint_period % config.num_iterations:
    # A checkpoint between two updates of one batch would resume without it (the batch is not saved).
    return (
        f"num_iterations={config.num_iterations} trains each sampled batch that many steps: checkpoint_period="
        f"{config.checkpoint_period} must be a multiple of it, so that every checkpoint falls between batches"
    )
  return None


def lora_problem(config: Config) -> str | None:
  """LoRA's and QLoRA's settings, and what a run cannot combine with them or with distillation from a teacher."""
  try:
    re.compile(config.lora_module_path)
  except re.error as e:
    return f"config key 'lora_module_path' = {config.lora_module_path!r} is not a regular expression: {e}"
  if config.lora_weight_qtype and not config.lora_rank:
    return (
        f"lora_weight_qtype={config.lora_weight_qtype!r} quantizes the frozen base of a LoRA run (QLoRA): "
        "set lora_rank > 0, or lora_weight_qtype=''"
    )
  if config.lora_weight_qtype and config.quantization:
    return (
        f"lora_weight_qtype={config.lora_weight_qtype!r} with quantization={config.quantization!r}: QLoRA stores its "
        "base quantized and runs the matmuls on the dequantized weights; set quantization=''"
    )
  if config.distill_logits_path and (config.num_vocab_tiling > 1 or config.eval_interval):
    return (
        f"distill_logits_path={config.distill_logits_path!r} holds the teacher's top-k logits of the training batches, "
        "read beside full student logits: set num_vocab_tiling=1 and eval_interval=0 (or distill in the step)"
    )
  objective = next((key for key in (*PREFERENCE_KEYS, "use_grpo") if getattr(config, key)), None)
  if (config.teacher_overrides.strip() or config.distill_logits_path) and objective:
    return f"teacher_overrides (distillation) with {objective}=true: each is the run's loss; set teacher_overrides=''"
  if config.lora_rank and config.opt_type == "muon":
    return (
        "lora_rank > 0 with opt_type=muon: LoRA's adapters are low-rank factors, not the weight matrices Muon "
        "orthogonalises; set opt_type=adamw"
    )
  if config.lora_rank and config.use_qk_clip:
    return (
        "lora_rank > 0 with use_qk_clip=true: QK-Clip rescales the query/key kernels after each update, "
        "which LoRA keeps frozen; set use_qk_clip=false"
    )
  if config.lora_rank and config.load_full_state_path:
    return (
        "lora_rank > 0 with load_full_state_path: a LoRA run starts from base parameters "
        "(load_parameters_path) and a fresh optimizer for its adapters"
    )
  return None


def feature_distillation_problem(config: Config) -> str | None:
  """distill_beta > 0 makes each attention layer return its out-projection output (`ops.attention.OUT_PROJECTION`),
  MaxText's switch: where that cannot exist or be read, and layer indices outside the model, are refused.

  A run's teacher takes its student's distill_beta (`training.distill.load_teacher`), so it captures too; whether
  the teacher has the chosen layers is checked there, against its own depth.
  """
  if config.distill_layer_indices and not config.distill_beta:
    return (
        f"distill_layer_indices={list(config.distill_layer_indices)} picks the layers of the feature loss, which "
        "distill_beta=0 turns off: set distill_beta > 0, or distill_layer_indices=null"
    )
  if not config.distill_beta:
    return None
  if config.distill_logits_path:
    return (
        f"distill_beta={config.distill_beta} compares the teacher's attention out-projection outputs with the "
        "student's, which only a teacher in the step has, never offline logits: set teacher_overrides (not "
        "distill_logits_path), or distill_beta=0"
    )
  blocks = [stack for stack in families.lookup(config.decoder_block).stacks if stack.sublayers]
  if blocks:
    return (
        f"distill_beta={config.distill_beta} with decoder_block={config.decoder_block!r}: the feature loss compares "
        "each decoder layer's attention out-projection output, and this family stacks blocks of "
        f"{len(blocks[0].sublayers)} layers ({', '.join(blocks[0].sublayers)}), which return none per layer "
        "(MaxText reads them from a stack of single layers too); set distill_beta=0"
    )
  if config.ici_pipeline_parallelism > 1 or config.dcn_pipeline_parallelism > 1:
    return (
        f"distill_beta={config.distill_beta} with pipeline parallelism: the pipeline combines per-layer values over "
        "its micro-batches (maxima, means), and the out-projection outputs are per token; set distill_beta=0 or "
        "ici_pipeline_parallelism=dcn_pipeline_parallelism=1"
    )
  bad = [i for i in config.distill_layer_indices if not 0 <= i < config.num_decoder_layers]
  if bad:
    return (
        f"distill_layer_indices={list(config.distill_layer_indices)}: {bad} outside the model's layers; each must be "
        f"in 0..{config.num_decoder_layers - 1} (num_decoder_layers={config.num_decoder_layers}), or null for all"
    )
  return None
