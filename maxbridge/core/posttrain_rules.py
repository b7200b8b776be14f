"""What a post-training run's config must satisfy: one objective at a time, each on the data it reads (the
preference losses and GRPO). Each rule returns what is wrong, or None; `config_rules.validate` raises it as a
ConfigError. Pure Python, as config_rules.
"""

from __future__ import annotations

import re
from typing import Any

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
