"""Configuration: base.yml defaults, a preset or YAML file, then overrides.

Pure Python on purpose (no jax import), so the CLI can reject a bad key
before paying for JAX start-up.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import yaml

from maxbridge import files

if typing.TYPE_CHECKING:
  from maxbridge.ops import rotary

CONFIG_DIR = Path(__file__).parent / "configs"
BASE_CONFIG = CONFIG_DIR / "base.yml"
PRESET_DIR = CONFIG_DIR / "models"
MESH_AXES = ("data", "fsdp", "tensor", "expert")  # maxbridge.sharding builds the mesh with these names


# Decoder families, by MaxText's names: llama2 (also Mistral and Qwen3 through
# sliding_window_size / use_qk_norm), gpt3 (GPT-2/3), mixtral (MoE), deepseek (MLA + MoE).
DECODER_BLOCKS = ("llama2", "mistral", "qwen3", "gpt3", "mixtral", "deepseek")
# MaxText's `quantization` values ("" = float). Each library accepts a subset.
QUANTIZATIONS = ("", "int8", "int4", "fp8", "nf4")
QUANTIZATIONS_BY_LIBRARY = {"aqt": ("", "int8"), "qwix": ("", "int8", "int4", "fp8")}


class ConfigError(ValueError):
  """A configuration key or value that cannot be used; the message says which and why."""


@dataclasses.dataclass(frozen=True, slots=True)
class Config:
  """A validated, immutable run configuration. Defaults live in configs/base.yml."""

  # model
  model_name: str
  decoder_block: str
  base_emb_dim: int
  base_num_query_heads: int
  base_num_kv_heads: int
  head_dim: int
  base_mlp_dim: int
  base_num_decoder_layers: int
  vocab_size: int
  max_target_length: int
  dtype: str
  weight_dtype: str
  normalization_layer_epsilon: float
  rope_max_timescale: int
  rope_type: str
  rope_use_scale: bool
  rope_factor: float
  rope_low_freq_factor: float
  rope_high_freq_factor: float
  original_max_position_embeddings: int
  scan_layers: bool
  param_scan_axis: int
  remat_policy: str
  logits_via_embedding: bool
  pure_nnx: bool
  enable_nnx: bool
  pure_nnx_decoder: bool
  seed: int
  override_model_config: bool
  # model families (MaxText names; see configs/base.yml)
  sliding_window_size: int
  use_qk_norm: bool
  trainable_position_size: int
  num_experts: int
  num_experts_per_tok: int
  moe_mlp_dim: int
  sparse_matmul: bool
  load_balance_loss_weight: float
  shared_experts: int
  routed_score_func: str
  routed_bias: bool
  routed_scaling_factor: float
  n_routing_groups: int
  topk_routing_group: int
  first_num_dense_layers: int
  q_lora_rank: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  # training
  run_name: str
  base_output_directory: str
  steps: int
  per_device_batch_size: int
  learning_rate: float
  learning_rate_schedule_steps: int
  warmup_steps_fraction: float
  cosine_learning_rate_final_fraction: float
  adam_b1: float
  adam_b2: float
  adam_eps: float
  adam_weight_decay: float
  gradient_clipping_threshold: float
  gradient_accumulation_steps: int
  z_loss_multiplier: float
  num_vocab_tiling: int
  use_qk_clip: bool
  qk_clip_threshold: float
  dataset_type: str
  dataset_path: str
  sft_train_on_completion_only: bool
  tokenizer_path: str
  use_dpo: bool
  dpo_beta: float
  dpo_label_smoothing: float
  use_grpo: bool
  num_generations: int
  grpo_beta: float
  grpo_epsilon: float
  reward_function: str
  eval_interval: int
  eval_steps: int
  enable_checkpointing: bool
  checkpoint_period: int
  max_to_keep: int
  log_period: int
  load_parameters_path: str
  load_full_state_path: str
  # LoRA fine-tuning (see maxbridge/lora.py)
  lora_rank: int
  lora_alpha: float
  lora_module_path: str
  lora_dropout: float
  lora_weight_qtype: str
  # inference (maxbridge.engine)
  max_prefill_predict_length: int
  decode_sampling_strategy: str
  decode_sampling_temperature: float
  decode_sampling_top_k: int
  decode_sampling_nucleus_p: float
  stack_prefill_result_cache: bool
  # quantization (see maxbridge/quantization.py)
  quantization: str
  use_qwix_quantization: bool
  checkpoint_is_quantized: bool
  quantization_local_shard_count: int
  # sharding
  ici_data_parallelism: int
  ici_fsdp_parallelism: int
  ici_tensor_parallelism: int
  ici_expert_parallelism: int
  logical_axis_rules: tuple
  # multi-process
  num_processes: int
  process_id: int
  coordinator_address: str

  def __post_init__(self) -> None:
    # Coercing here rather than in load_config means Config(...),
    # replace() and load_config() can never disagree about what is valid.
    for name, kind in _FIELD_TYPES.items():
      value = getattr(self, name)
      coerced = _coerce(name, value, kind)
      if coerced is not value:
        object.__setattr__(self, name, coerced)
    _validate(self)

  # MaxText reads model sizes through these (it scales base_* by a global
  # factor); we keep the names so ported code reads the same, without the scale.
  @property
  def emb_dim(self) -> int:
    return self.base_emb_dim

  @property
  def num_query_heads(self) -> int:
    return self.base_num_query_heads

  @property
  def num_kv_heads(self) -> int:
    return self.base_num_kv_heads

  @property
  def mlp_dim(self) -> int:
    return self.base_mlp_dim

  @property
  def num_decoder_layers(self) -> int:
    return self.base_num_decoder_layers

  @property
  def normalization(self) -> str:
    """The layers' and final norm: "layer_norm" (GPT-2/3, with a bias) or "rms_norm" (every other family)."""
    return "layer_norm" if self.decoder_block == "gpt3" else "rms_norm"

  @property
  def rope_scaling(self) -> rotary.Llama3Scaling | None:
    """Llama 3.1's RoPE frequency scaling, or None for plain RoPE."""
    from maxbridge.ops import rotary  # here, not at the top: ops import config (through sharding)

    if self.rope_type != "llama3.1" or not self.rope_use_scale:
      return None
    return rotary.Llama3Scaling(
        self.rope_factor, self.rope_low_freq_factor, self.rope_high_freq_factor, self.original_max_position_embeddings
    )

  @property
  def schedule_steps(self) -> int:
    """The steps the learning-rate schedule spans: learning_rate_schedule_steps, or steps when -1."""
    return self.steps if self.learning_rate_schedule_steps == -1 else self.learning_rate_schedule_steps

  def replace(self, **changes: Any) -> Config:
    """A new Config with `changes` applied and validated."""
    _check_known(changes, source="replace()")
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return {name: getattr(self, name) for name in _FIELD_TYPES}

  def to_yaml(self, path: str | os.PathLike[str]) -> None:
    """Write every key to `path`; a reader never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False))


_FIELD_TYPES: dict[str, type] = {f.name: typing.get_type_hints(Config)[f.name] for f in dataclasses.fields(Config)}

_BOOL_WORDS = {"true": True, "yes": True, "1": True, "false": False, "no": False, "0": False}


def _coerce(key: str, value: Any, kind: type) -> Any:
  """`value` as `kind`, accepting the strings a command line or YAML file gives."""
  if kind is bool:
    if isinstance(value, bool):
      return value
    if isinstance(value, int) and value in (0, 1):
      return bool(value)
    if isinstance(value, str) and value.strip().lower() in _BOOL_WORDS:
      return _BOOL_WORDS[value.strip().lower()]
  elif kind is int:
    # bool is an int subclass; `steps=True` is a mistake, not 1.
    if isinstance(value, int) and not isinstance(value, bool):
      return value
    if isinstance(value, str):
      try:
        return int(value.strip())
      except ValueError:
        pass
  elif kind is float:
    if isinstance(value, float):
      return value
    if isinstance(value, int) and not isinstance(value, bool):
      return float(value)
    # PyYAML reads `1e-5` (no dot) as a string, so files need this too.
    if isinstance(value, str):
      try:
        return float(value.strip())
      except ValueError:
        pass
  elif kind is tuple:
    return _axis_rules(key, value)
  elif kind is str:
    if isinstance(value, str):
      return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return str(value)
  expected = "bool (true/false/yes/no/1/0)" if kind is bool else kind.__name__
  raise ConfigError(f"config key {key!r} expects {expected}, got {value!r}")


def _axis_rules(key: str, value: Any) -> tuple[tuple[str, Any], ...]:
  """[[logical, mesh axes], ...] -> a hashable tuple; [] or null means replicated."""
  if isinstance(value, str):
    try:
      value = yaml.safe_load(value)
    except yaml.YAMLError as e:
      raise ConfigError(f"config key {key!r} is not valid YAML: {e}") from e
  if not isinstance(value, (list, tuple)):
    raise ConfigError(f"config key {key!r} expects a list of [logical_name, mesh_axes], got {value!r}")
  rules = []
  for entry in value:
    if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str)):
      raise ConfigError(f"config key {key!r}: entry {entry!r} is not [logical_name, mesh_axes]")
    name, axes = entry
    axes = (axes,) if isinstance(axes, str) else tuple(axes or ())
    unknown = [a for a in axes if a not in MESH_AXES]
    if unknown:
      raise ConfigError(f"config key {key!r}: {name!r} maps to unknown mesh axes {unknown}; valid: {list(MESH_AXES)}")
    rules.append((name, axes or None))
  return tuple(rules)


def _positive(value: float) -> bool:
  return value > 0


# Each rule: key, test the value must pass, and what a valid value is.
_RULES: tuple[tuple[str, Callable[[Any], bool], str], ...] = (
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
        for key in ("ici_data_parallelism", "ici_fsdp_parallelism", "ici_tensor_parallelism", "ici_expert_parallelism")
    ),
    ("num_processes", _positive, "a positive integer"),
    ("process_id", lambda v: v >= 0, ">= 0"),
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
        )
    ),
    *(
        (key, lambda v: v >= 0, ">= 0 (0 disables it)")
        for key in ("sliding_window_size", "trainable_position_size", "q_lora_rank", "shared_experts")
    ),
    *(
        (key, lambda v: v == -1 or v > 0, "a positive integer, or -1 for no group-limited routing")
        for key in ("n_routing_groups", "topk_routing_group")
    ),
    ("first_num_dense_layers", lambda v: v >= 0, ">= 0"),
    ("load_balance_loss_weight", lambda v: v >= 0, ">= 0 (0 disables the loss)"),
    ("routed_scaling_factor", _positive, "> 0"),
    ("rope_factor", lambda v: v >= 1, ">= 1 (how many times slower the longest wavelengths turn)"),
    ("rope_low_freq_factor", _positive, "> 0"),
    ("normalization_layer_epsilon", _positive, "> 0"),
    ("adam_eps", _positive, "> 0"),
    ("learning_rate", lambda v: v >= 0, ">= 0"),
    ("adam_weight_decay", lambda v: v >= 0, ">= 0"),
    ("gradient_clipping_threshold", lambda v: v >= 0, ">= 0 (0 disables clipping)"),
    ("z_loss_multiplier", lambda v: v >= 0, ">= 0"),
    ("num_vocab_tiling", _positive, "a positive integer (1 disables tiling)"),
    ("dpo_beta", _positive, "> 0"),
    ("dpo_label_smoothing", lambda v: 0 <= v <= 0.5, "in [0, 0.5] (0 is plain DPO)"),
    ("num_generations", lambda v: v >= 2, ">= 2 (GRPO's advantages compare the completions of one prompt)"),
    ("grpo_beta", lambda v: v >= 0, ">= 0 (0 drops the KL penalty)"),
    ("grpo_epsilon", lambda v: 0 < v < 1, "in (0, 1) (the policy ratio is clipped to [1 - epsilon, 1 + epsilon])"),
    ("qk_clip_threshold", lambda v: 0 < v < float("inf"), "a finite number > 0"),
    (
        "quantization_local_shard_count",
        lambda v: v >= -1,
        "-1 (one shard per slice), 0 (float weight gradients) or a positive shard count",
    ),
    ("eval_interval", lambda v: v >= 0, ">= 0 (0 disables evaluation)"),
    ("lora_rank", lambda v: v >= 0, ">= 0 (0 disables LoRA)"),
    ("lora_alpha", _positive, "> 0 (adapters are scaled by lora_alpha / lora_rank)"),
    ("lora_dropout", lambda v: 0 <= v < 1, "in [0, 1) (the probability of dropping an adapter input feature)"),
    ("warmup_steps_fraction", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("cosine_learning_rate_final_fraction", lambda v: 0 <= v <= 1, "in [0, 1]"),
    ("adam_b1", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("adam_b2", lambda v: 0 <= v < 1, "in [0, 1)"),
    ("max_prefill_predict_length", _positive, "a positive integer"),
    ("decode_sampling_temperature", lambda v: 0 <= v < float("inf"), ">= 0 (0 is greedy)"),
    ("decode_sampling_top_k", lambda v: v >= 0, ">= 0"),
    ("decode_sampling_nucleus_p", lambda v: v == -1 or 0 < v <= 1, "in (0, 1], or -1 when unused"),
)

_CHOICES: dict[str, tuple[Any, ...]] = {
    "decoder_block": DECODER_BLOCKS,
    "routed_score_func": ("", "sigmoid"),
    "rope_type": ("default", "llama3.1"),
    "dtype": ("float32", "bfloat16"),
    "weight_dtype": ("float32", "bfloat16"),
    "remat_policy": ("none", "full", "minimal"),
    "param_scan_axis": (0, 1),
    "dataset_type": ("embedded", "synthetic", "text", "sft"),
    "decode_sampling_strategy": ("greedy", "weighted", "topk", "nucleus"),
    "quantization": QUANTIZATIONS,
    "lora_weight_qtype": ("", "int8", "nf4"),
}


def _validate(cfg: Config) -> None:
  for key, kind in _FIELD_TYPES.items():
    value = getattr(cfg, key)
    if kind is float and not math.isfinite(value):
      raise ConfigError(f"config key {key!r} = {value!r} is invalid; it must be a finite number")
  for key, ok, valid in _RULES:
    value = getattr(cfg, key)
    if not ok(value):  # written as "not ok" so NaN fails too
      raise ConfigError(f"config key {key!r} = {value!r} is invalid; it must be {valid}")
  for key, choices in _CHOICES.items():
    value = getattr(cfg, key)
    if value not in choices:
      listed = ", ".join(repr(c) for c in choices)
      raise ConfigError(f"config key {key!r} = {value!r} is invalid; valid values: {listed}")
  if cfg.base_num_query_heads % cfg.base_num_kv_heads:
    raise ConfigError(
        f"base_num_query_heads={cfg.base_num_query_heads} must be a multiple of "
        f"base_num_kv_heads={cfg.base_num_kv_heads}: each kv head serves an equal group of query heads"
    )
  if cfg.max_target_length < 2:
    # One token has no next token to predict: every loss would be over zero targets.
    raise ConfigError(
        f"max_target_length={cfg.max_target_length} is too short to train on; it must be >= 2 "
        "(each token predicts the next)"
    )
  if cfg.trainable_position_size and cfg.max_target_length > cfg.trainable_position_size:
    raise ConfigError(
        f"max_target_length={cfg.max_target_length} exceeds trainable_position_size="
        f"{cfg.trainable_position_size}: the learned position table has no row for positions past "
        f"{cfg.trainable_position_size - 1}; lower max_target_length or raise trainable_position_size"
    )
  if cfg.load_parameters_path and cfg.load_full_state_path:
    raise ConfigError(
        "load_parameters_path and load_full_state_path are both set: a new run starts from one checkpoint; "
        "set load_parameters_path for its parameters only, or load_full_state_path for parameters, "
        "optimizer state and step"
    )
  if cfg.process_id >= cfg.num_processes:
    raise ConfigError(f"process_id={cfg.process_id} must be below num_processes={cfg.num_processes}")
  _validate_family(cfg)
  _validate_quantization(cfg)
  _validate_lora(cfg)
  if cfg.dataset_type == "text" and not cfg.dataset_path:
    raise ConfigError("dataset_type='text' needs dataset_path (a text file to train on)")
  if cfg.use_dpo and cfg.dataset_type not in ("embedded", "sft"):
    raise ConfigError(
        f"use_dpo=true reads preference pairs: dataset_type must be 'sft' (prompt/chosen/rejected .jsonl rows "
        f"in dataset_path) or 'embedded' (the built-in set), got {cfg.dataset_type!r}"
    )
  if cfg.use_dpo and cfg.num_vocab_tiling > 1:
    raise ConfigError("use_dpo=true computes full logits for its log-probabilities; set num_vocab_tiling=1")
  _validate_grpo(cfg)


# GRPO's built-in verifiable rewards for the built-in arithmetic prompts (maxbridge/posttrain/grpo.py).
GRPO_REWARDS = ("arithmetic", "exact_match", "format")


def _validate_grpo(cfg: Config) -> None:
  if cfg.reward_function not in GRPO_REWARDS and not re.fullmatch(
      r"[A-Za-z_][\w]*(\.[A-Za-z_]\w*)+", cfg.reward_function
  ):
    listed = ", ".join(repr(r) for r in GRPO_REWARDS)
    raise ConfigError(
        f"config key 'reward_function' = {cfg.reward_function!r} is invalid; valid values: {listed}, "
        "or the dotted path of a Python callable (package.module.function)"
    )
  if not cfg.use_grpo:
    return
  if cfg.use_dpo:
    raise ConfigError("use_grpo=true and use_dpo=true: a run trains one objective; set one of them to false")
  if cfg.dataset_type != "embedded":
    raise ConfigError(
        f"use_grpo=true samples completions of the built-in arithmetic prompts: dataset_type must be 'embedded', "
        f"got {cfg.dataset_type!r}"
    )
  if cfg.max_target_length <= cfg.max_prefill_predict_length:
    raise ConfigError(
        f"use_grpo=true samples max_target_length - max_prefill_predict_length tokens per completion: "
        f"max_target_length={cfg.max_target_length} must exceed max_prefill_predict_length="
        f"{cfg.max_prefill_predict_length}"
    )
  if cfg.num_vocab_tiling > 1:
    raise ConfigError("use_grpo=true computes full logits for its log-probabilities; set num_vocab_tiling=1")
  if cfg.num_processes > 1:
    raise ConfigError(f"use_grpo=true samples in one process: num_processes={cfg.num_processes} must be 1")


def _validate_lora(cfg: Config) -> None:
  try:
    re.compile(cfg.lora_module_path)
  except re.error as e:
    raise ConfigError(f"config key 'lora_module_path' = {cfg.lora_module_path!r} is not a regular expression: {e}") from e
  if cfg.lora_weight_qtype and not cfg.lora_rank:
    raise ConfigError(
        f"lora_weight_qtype={cfg.lora_weight_qtype!r} quantizes the frozen base of a LoRA run (QLoRA): "
        "set lora_rank > 0, or lora_weight_qtype=''"
    )
  if cfg.lora_weight_qtype and cfg.quantization:
    raise ConfigError(
        f"lora_weight_qtype={cfg.lora_weight_qtype!r} with quantization={cfg.quantization!r}: QLoRA stores its "
        "base quantized and runs the matmuls on the dequantized weights; set quantization=''"
    )
  if cfg.lora_rank and cfg.use_qk_clip:
    raise ConfigError(
        "lora_rank > 0 with use_qk_clip=true: QK-Clip rescales the query/key kernels after each update, "
        "which LoRA keeps frozen; set use_qk_clip=false"
    )
  if cfg.lora_rank and cfg.load_full_state_path:
    raise ConfigError(
        "lora_rank > 0 with load_full_state_path: a LoRA run starts from base parameters "
        "(load_parameters_path) and a fresh optimizer for its adapters"
    )


def _validate_family(cfg: Config) -> None:
  """Cross-key rules of the decoder families; each message names the keys at fault."""
  block = cfg.decoder_block
  if cfg.use_qk_clip and cfg.use_qk_norm:
    raise ConfigError(
        "use_qk_clip=true with use_qk_norm=true: the query/key RMSNorm undoes any scaling of the "
        "query kernel, and already bounds the logits; set use_qk_clip=false"
    )
  if cfg.rope_type == "llama3.1" and block in ("gpt3", "deepseek"):
    raise ConfigError(
        f"rope_type='llama3.1' scales the RoPE of Llama-style attention; decoder_block={block!r} has its own "
        "positions: set rope_type='default'"
    )
  if cfg.rope_high_freq_factor <= cfg.rope_low_freq_factor:
    raise ConfigError(
        f"rope_high_freq_factor={cfg.rope_high_freq_factor} must exceed rope_low_freq_factor="
        f"{cfg.rope_low_freq_factor}: they bound the band of wavelengths that blends scaled and unscaled"
    )
  if cfg.num_experts_per_tok > cfg.num_experts:
    raise ConfigError(f"num_experts_per_tok={cfg.num_experts_per_tok} must be at most num_experts={cfg.num_experts}")
  if block in ("mixtral", "deepseek") and cfg.num_experts < 2:
    raise ConfigError(f"decoder_block={block!r} routes tokens to experts: num_experts must be >= 2")
  if block in ("gpt3", "deepseek") and cfg.base_num_query_heads != cfg.base_num_kv_heads:
    raise ConfigError(
        f"decoder_block={block!r} has no grouped-query attention: base_num_kv_heads="
        f"{cfg.base_num_kv_heads} must equal base_num_query_heads={cfg.base_num_query_heads}"
    )
  if block == "qwen3" and not cfg.use_qk_norm:
    raise ConfigError(
        "decoder_block='qwen3' normalises each query and key head: set use_qk_norm=true "
        "(without it the model is decoder_block='llama2')"
    )
  # No such rule for mistral: Mistral 7B v0.2 and later have no window
  # (Hugging Face's sliding_window: null), and import as sliding_window_size=0.
  if block in ("gpt3", "deepseek") and (cfg.sliding_window_size or cfg.use_qk_norm):
    raise ConfigError(
        f"decoder_block={block!r} has its own attention, which reads neither sliding_window_size="
        f"{cfg.sliding_window_size} nor use_qk_norm={cfg.use_qk_norm}: leave them at 0 and false"
    )
  if block == "gpt3" and cfg.trainable_position_size == 0:
    raise ConfigError(
        "decoder_block='gpt3' learns absolute positions: set trainable_position_size "
        "(the longest sequence it can read, e.g. max_target_length)"
    )
  if block == "deepseek":
    if cfg.first_num_dense_layers > cfg.base_num_decoder_layers:
      raise ConfigError(
          f"first_num_dense_layers={cfg.first_num_dense_layers} exceeds "
          f"base_num_decoder_layers={cfg.base_num_decoder_layers}"
      )
    if cfg.qk_rope_head_dim % 2:
      raise ConfigError(f"qk_rope_head_dim={cfg.qk_rope_head_dim} must be even (RoPE rotates pairs)")
    groups, top_groups = cfg.n_routing_groups, cfg.topk_routing_group
    if (groups == -1) != (top_groups == -1):
      raise ConfigError(f"n_routing_groups={groups} and topk_routing_group={top_groups}: set both, or both to -1")
    if groups != -1:
      if cfg.num_experts % groups or cfg.num_experts // groups < 2:
        raise ConfigError(
            f"n_routing_groups={groups} must split num_experts={cfg.num_experts} into equal "
            "groups of at least 2 experts (groups are ranked by their top-2 scores)"
        )
      if top_groups > groups:
        raise ConfigError(f"topk_routing_group={top_groups} exceeds n_routing_groups={groups}")
      if cfg.num_experts_per_tok > top_groups * (cfg.num_experts // groups):
        raise ConfigError(
            f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds the experts in "
            f"topk_routing_group={top_groups} groups of {cfg.num_experts // groups}"
        )


def _validate_quantization(cfg: Config) -> None:
  library = "qwix" if cfg.use_qwix_quantization else "aqt"
  supported = QUANTIZATIONS_BY_LIBRARY[library]
  if cfg.quantization not in supported:
    listed = ", ".join(repr(c) for c in supported)
    raise ConfigError(
        f"config key 'quantization' = {cfg.quantization!r} is not supported with use_qwix_quantization="
        f"{str(cfg.use_qwix_quantization).lower()} ({library}); valid values: {listed}"
    )
  if cfg.checkpoint_is_quantized and not cfg.quantization:
    raise ConfigError(
        "checkpoint_is_quantized=true needs the quantization its weights were made with: set quantization "
        f"(one of {', '.join(repr(c) for c in supported if c)})"
    )


def _check_known(values: Mapping[str, Any], source: str) -> None:
  for key in values:
    if key not in _FIELD_TYPES:
      raise ConfigError(f"{_unknown(key)} (from {source})")


def _unknown(key: Any) -> str:
  close = difflib.get_close_matches(str(key), _FIELD_TYPES, n=1)
  hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(_FIELD_TYPES)}"
  return f"unknown config key {key!r}; {hint}"


# MaxText keys (its base.yml) that change where a run logs, profiles or stores
# things, never what it computes: a MaxText YAML may carry them, and they are ignored.
_MAXTEXT_IGNORED = frozenset(
    {
        "hardware",
        "enable_tensorboard",
        "metrics_file",
        "gcs_metrics",
        "save_config_to_gcs",
        "log_config",
        "profiler",
        "profiler_steps",
        "skip_first_n_steps_for_profiler",
        "profile_cleanly",
        "upload_all_profiler_results",
        "jax_cache_dir",
        "jax_debug_log_modules",
        "enable_goodput_recording",
        "monitor_goodput",
        "goodput_upload_interval_seconds",
        "enable_pathways_goodput",
        "monitor_step_time_deviation",
        "step_deviation_interval_seconds",
        "enable_checkpoint_cloud_logger",
        "async_checkpointing",
        "checkpoint_storage_use_ocdbt",
        "checkpoint_storage_use_zarr3",
        "checkpoint_storage_concurrent_gb",
        "checkpoint_storage_target_data_file_size_bytes",
        "dump_hlo",
        "dump_hlo_local_dir",
        "dump_hlo_gcs_dir",
        "dump_hlo_module_name",
        "dump_hlo_xla_flags",
        "dump_hlo_upload_all",
    }
)

# MaxText keys whose value is fixed here: accepted at that value (what maxbridge
# computes), refused at any other, since the numbers would differ.
_MAXTEXT_FIXED: dict[str, Any] = {
    "global_parameter_scale": 1,
    "mlp_activations": ["silu", "linear"],
    "dropout_rate": 0,
    "fused_qkv": False,
    "fused_mlp": False,
    "num_slices": 1,
    "dcn_data_parallelism": -1,
    "dcn_fsdp_parallelism": 1,
    "dcn_tensor_parallelism": 1,
    "dcn_pipeline_parallelism": 1,
    "ici_sequence_parallelism": 1,
    "ici_pipeline_parallelism": 1,
}


# MaxText's names for keys that maxbridge spells otherwise: read as maxbridge's key.
_MAXTEXT_RENAMED = {"max_num_checkpoints_to_keep": "max_to_keep"}
# MaxText keys that one maxbridge key covers together with another: refused, naming ours.
_ONE_SEED = (
    "seed (maxbridge's one seed sets both parameter init and data order; MaxText's "
    "init_weights_seed and data_shuffle_seed set one each)"
)
_MAXTEXT_MERGED = {"init_weights_seed": _ONE_SEED, "data_shuffle_seed": _ONE_SEED}


def _known_only(values: Mapping[str, Any], source: str) -> dict[str, Any]:
  """`values` without MaxText's keys that do not change the numbers (each reported by name),
  MaxText's names for our keys renamed; any other key this Config lacks is an error, all of them named at once."""
  ignored, problems, renamed = [], [], {}
  for key, value in values.items():
    if key in _FIELD_TYPES:
      continue
    if key in _MAXTEXT_RENAMED:
      ours = _MAXTEXT_RENAMED[key]
      if ours in values:
        problems.append(f"{key!r} (MaxText's name for {ours!r}) and {ours!r} are both given; keep one")
      renamed[ours] = value
      continue
    if key in _MAXTEXT_MERGED:
      problems.append(f"MaxText key {key!r} is not supported; set {_MAXTEXT_MERGED[key]}")
      continue
    if key in _MAXTEXT_IGNORED:
      ignored.append(key)
    elif key in _MAXTEXT_FIXED:
      parsed = yaml.safe_load(value) if isinstance(value, str) else value
      fixed = _MAXTEXT_FIXED[key]
      if parsed == fixed or (isinstance(fixed, list) and parsed == tuple(fixed)):
        ignored.append(key)
      else:
        problems.append(f"MaxText key {key!r} = {value!r} is not supported; maxbridge computes only {key}={fixed!r}")
    else:
      problems.append(_unknown(key))
  if len(problems) == 1:
    raise ConfigError(f"{problems[0]} (from {source})")
  if problems:
    raise ConfigError(
        f"{len(problems)} config keys are not supported (from {source}); each would change what is computed:\n  "
        + "\n  ".join(problems)
    )
  if ignored:
    warnings.warn(
        f"ignoring MaxText config keys that do not change what maxbridge computes (from {source}): " + ", ".join(ignored),
        stacklevel=3,
    )
  return {**{key: value for key, value in values.items() if key in _FIELD_TYPES}, **renamed}


class _UniqueKeyLoader(yaml.SafeLoader):
  """safe_load, except that a key given twice is an error: YAML would silently keep the last."""

  def construct_mapping(self, node, deep=False):
    seen = {}
    for key_node, _ in node.value:
      key = self.construct_object(key_node, deep=deep)
      if key in seen:
        raise yaml.constructor.ConstructorError(
            None,
            None,
            f"key {key!r} appears twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1})",
            key_node.start_mark,
        )
      seen[key] = key_node.start_mark.line
    return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path) -> dict[str, Any]:
  try:
    text = path.read_bytes().decode("utf-8")
  except UnicodeDecodeError as e:
    raise ConfigError(f"{path} is not UTF-8 text (byte {e.start}); YAML configs must be UTF-8") from e
  except OSError as e:
    raise ConfigError(f"{path} cannot be read: {e.strerror or e}") from e
  try:
    data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: builds plain data only
  except yaml.MarkedYAMLError as e:
    where = f"{path}:{e.problem_mark.line + 1}" if e.problem_mark else str(path)
    raise ConfigError(f"{where}: not valid YAML: {e.problem}") from e
  except yaml.YAMLError as e:
    raise ConfigError(f"{path} is not valid YAML: {' '.join(str(e).split())}") from e
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"{path} must hold a mapping of config keys, got {type(data).__name__}")
  return data


def _parse_override(text: str) -> tuple[str, str]:
  # The value stays a string: _coerce converts it by the key's declared type,
  # so `remat_policy=none` stays the string 'none' and `run_name=123` a name.
  key, sep, value = text.partition("=")
  if not sep or not key.strip():
    raise ConfigError(f"override {text!r} is not of the form key=value")
  return key.strip(), value.strip()


def available_presets() -> list[str]:
  """Names accepted by load_config, one per file in configs/models/."""
  return sorted(p.stem for p in PRESET_DIR.glob("*.yml"))


def _resolve(preset_or_path: str) -> Path:
  path = Path(preset_or_path)
  if path.suffix in (".yml", ".yaml") or path.is_file():
    if not path.is_file():
      raise ConfigError(f"config file {str(path)!r} does not exist")
    return path
  preset = PRESET_DIR / f"{preset_or_path}.yml"
  if not preset.is_file():
    raise ConfigError(f"unknown preset {preset_or_path!r}; available presets: {', '.join(available_presets())}")
  return preset


def load_config(preset_or_path: str | None = None, *overrides: str, **kwargs: Any) -> Config:
  """Build a Config from base.yml, a preset name or YAML path, then overrides.

  Later sources win: base.yml < preset/file < "key=value" strings < kwargs.
  As in MaxText, `model_name=<preset>` may name the preset instead.

      load_config("llama-tiny", "steps=20", pure_nnx=True)
      load_config(model_name="llama-tiny", steps=20)
  """
  named = [value for key, value in map(_parse_override, overrides) if key == "model_name"]
  named += [kwargs["model_name"]] if "model_name" in kwargs else []
  if preset_or_path is None:
    if not named:
      raise ConfigError(
          f"no model given: pass a preset or YAML path, or model_name=<preset>; presets: {', '.join(available_presets())}"
      )
    preset_or_path = str(named[-1])
  # MaxText's spelling (the CLI turns model_name= into the preset, so compare).
  by_model_name = bool(named) and preset_or_path == str(named[-1])
  values = _read_yaml(BASE_CONFIG)
  if set(values) != set(_FIELD_TYPES):
    # Guards the promise that base.yml documents every key.
    drift = sorted(set(values) ^ set(_FIELD_TYPES))
    raise ConfigError(f"{BASE_CONFIG} and Config disagree on keys: {drift}")

  path = _resolve(preset_or_path)
  model = _known_only(_read_yaml(path), source=str(path))
  values.update(model)
  values.update(_known_only(dict(map(_parse_override, overrides)), source="overrides"))
  values.update(_known_only(kwargs, source="keyword arguments"))
  if by_model_name and not _coerce("override_model_config", values["override_model_config"], bool):
    _refuse_model_overrides(values["model_name"], model, values)
  return Config(**values)


# Set by our preset files but not by MaxText's model files: a run's length, not the model's.
_RUN_KEYS_IN_PRESETS = frozenset({"model_name", "max_target_length"})


def _refuse_model_overrides(model_name: str, model: Mapping[str, Any], values: Mapping[str, Any]) -> None:
  """MaxText's rule where MaxText's spelling (model_name=) names the preset: its model keys are fixed.

  A positional preset, maxbridge's own spelling, takes overrides freely.
  """
  changed = [
      f"{key}={model[key]!r} (given {values[key]!r})"
      for key in model
      if key not in _RUN_KEYS_IN_PRESETS
      and _coerce(key, values[key], _FIELD_TYPES[key]) != _coerce(key, model[key], _FIELD_TYPES[key])
  ]
  if changed:
    raise ConfigError(
        f"model_name={model_name!r} sets {', '.join(changed)}; as in MaxText, overriding a model's own keys "
        "needs override_model_config=true (or name the preset positionally, which takes overrides freely)"
    )
