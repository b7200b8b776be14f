"""Configuration: base.yml defaults, a preset or YAML file, then overrides.

Here: reading the sources, coercing each value to its key's type, and Config.
The rules a value must pass are in maxbridge/core/config_rules.py; the keys a
file may hold (MaxText's among them), in maxbridge/core/config_keys.py; each
family's own rules, in its entry of the family registry (maxbridge/core/families/).
Pure Python on purpose (no jax import), so the CLI can reject a bad key
before paying for JAX start-up.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from maxbridge.core import config_keys, config_rules, families, files
from maxbridge.core.config_rules import ConfigError
from maxbridge.core.posttrain_rules import PREFERENCE_KEYS

CONFIG_DIR = Path(__file__).parent.parent / "configs"  # maxbridge/configs: data, beside the code that reads it
BASE_CONFIG = CONFIG_DIR / "base.yml"
PRESET_DIR = CONFIG_DIR / "models"
MESH_AXES = (
    "diloco",
    "data",
    "stage",
    "fsdp",
    "context",
    "tensor",
    "expert",
)  # MaxText's order; maxbridge.sharding builds the mesh with these names


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
  beta_fast: float
  beta_slow: float
  rope_truncate: bool
  rope_attention_scaling: bool
  mscale: float
  local_rope_max_timescale: int
  rope_linear_scaling_factor: float
  scan_layers: bool
  param_scan_axis: int
  remat_policy: str
  attention: str
  float32_logits: bool
  sa_block_q: int
  sa_block_kv: int
  sa_block_kv_compute: int
  sa_block_q_dkv: int
  sa_block_kv_dkv: int
  sa_block_kv_dkv_compute: int
  sa_block_q_dq: int
  sa_block_kv_dq: int
  sa_use_fused_bwd_kernel: bool
  sa_q_layout: str
  sa_k_layout: str
  sa_v_layout: str
  logits_via_embedding: bool
  normalize_embedding_logits: bool
  pure_nnx: bool
  enable_nnx: bool
  pure_nnx_decoder: bool
  seed: int
  override_model_config: bool
  # model families (MaxText names; see configs/base.yml)
  sliding_window_size: int
  use_qk_norm: bool
  attn_logits_soft_cap: float
  final_logits_soft_cap: float
  query_pre_attn_scalar: int
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
  norm_topk_prob: bool
  mlp_activations_limit: float
  n_routing_groups: int
  topk_routing_group: int
  first_num_dense_layers: int
  chunk_attn_window_size: int
  nope_layer_interval: int
  interleave_moe_layer_step: int
  temperature_tuning: bool
  temperature_tuning_scale: float
  temperature_tuning_floor_scale: float
  global_head_dim: int
  global_num_kv_heads: int
  global_rope_proportion: float
  share_kv_projections: bool
  hidden_size_per_layer_input: int
  num_kv_shared_layers: int
  use_double_wide_mlp: bool
  q_lora_rank: int
  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int
  use_indexer: bool
  indexer_n_heads: int
  indexer_head_dim: int
  indexer_topk: int
  partial_rotary_factor: float
  gdn_num_key_heads: int
  gdn_num_value_heads: int
  gdn_key_head_dim: int
  gdn_value_head_dim: int
  gdn_conv_kernel_dim: int
  gdn_chunk_size: int
  # multimodal (MaxText's keys; see configs/base.yml)
  use_multimodal: bool
  freeze_vision_encoder_params: bool
  image_size_for_vit: int
  num_channels_for_vit: int
  patch_size_for_vit: int
  conv_stride_for_vit: int
  hidden_size_for_vit: int
  intermediate_size_for_vit: int
  num_hidden_layers_for_vit: int
  num_attention_heads_for_vit: int
  vision_output_length: int
  normalization_layer_epsilon_for_vit: float
  image_placeholder: str
  image_token_index: int
  boi_token_index: int
  eoi_token_index: int
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
  opt_type: str
  muon_beta: float
  muon_weight_decay: float
  muon_consistent_rms: float
  muon_include_routers: bool
  gradient_clipping_threshold: float
  gradient_accumulation_steps: int
  z_loss_multiplier: float
  num_vocab_tiling: int
  mtp_num_layers: int
  mtp_loss_scaling_factor: float
  mtp_eval_target_module: int
  use_qk_clip: bool
  qk_clip_threshold: float
  teacher_overrides: str
  distill_alpha: float
  distill_temperature: float
  distill_logits_path: str
  distill_beta: float
  distill_feature_loss_type: str
  distill_layer_indices: tuple[int, ...]
  dataset_type: str
  dataset_path: str
  sft_train_on_completion_only: bool
  tokenizer_path: str
  grain_train_files: str
  grain_eval_files: str
  grain_file_type: str
  grain_worker_count: int
  grain_shuffle_buffer_size: int
  grain_skip_damaged_records: bool
  use_sft: bool
  restart_data_on_resume: bool
  data_columns: str
  add_bos: bool
  add_eos: bool
  use_dpo: bool
  dpo_beta: float
  dpo_label_smoothing: float
  use_orpo: bool
  orpo_lambda: float
  use_simpo: bool
  simpo_beta: float
  simpo_gamma: float
  simpo_label_smoothing: float
  use_kto: bool
  kto_beta: float
  kto_desirable_weight: float
  kto_undesirable_weight: float
  use_grpo: bool
  num_generations: int
  grpo_beta: float
  grpo_epsilon: float
  reward_function: str
  num_iterations: int
  epsilon_high: float
  grpo_kl_estimator: str
  importance_sampling_level: str
  loss_agg_mode: str
  scale_rewards: str
  grpo_advantage_std: str
  dynamic_sampling: bool
  max_num_gen_batches: int
  overlong_buffer_length: int
  overlong_penalty_factor: float
  off_policy_steps: int
  max_concurrency: int
  max_turns: int
  max_turn_tokens: int
  eval_interval: int
  eval_steps: int
  enable_checkpointing: bool
  checkpoint_period: int
  max_to_keep: int
  log_period: int
  load_parameters_path: str
  load_full_state_path: str
  # LoRA fine-tuning (see maxbridge/models/lora.py)
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
  speculative_mtp_tokens: int
  stack_prefill_result_cache: bool
  quantize_kvcache: bool
  kv_quant_dtype: str
  # quantization (see maxbridge/ops/quantization.py)
  quantization: str
  use_qwix_quantization: bool
  checkpoint_is_quantized: bool
  quantization_local_shard_count: int
  # sharding
  ici_diloco_parallelism: int
  ici_data_parallelism: int
  ici_pipeline_parallelism: int
  ici_fsdp_parallelism: int
  ici_context_parallelism: int
  ici_tensor_parallelism: int
  ici_expert_parallelism: int
  dcn_diloco_parallelism: int
  dcn_data_parallelism: int
  dcn_pipeline_parallelism: int
  dcn_fsdp_parallelism: int
  num_layers_per_pipeline_stage: int
  num_pipeline_repeats: int
  num_pipeline_microbatches: int
  pipeline_parallel_layers: int
  compile_topology: str
  compile_topology_num_slices: int
  parameter_memory_host_offload: bool
  optimizer_memory_host_offload: bool
  shard_optimizer_over_data: bool
  enable_diloco: bool
  diloco_sync_period: int
  diloco_outer_lr: float
  diloco_outer_momentum: float
  context_parallel_strategy: str
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
    config_rules.validate(self)

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
  def family(self) -> families.Family:
    """The entry of `decoder_block` in the family registry: its stacks, norm, cache, Hugging Face tables, rules."""
    return families.lookup(self.decoder_block)

  @property
  def normalization(self) -> str:
    """The layers' and final norm, as the family names it: "layer_norm" (with a bias, GPT-2/3), "rms_norm", or
    "zero_centred_rms_norm" (times 1 + scale, Qwen3-Next)."""
    return self.family.norm

  @property
  def llama3_rope_scaling(self) -> bool:
    """Whether RoPE takes Llama 3.1's frequency scaling (rope_type='llama3.1' with rope_use_scale)."""
    return self.rope_type == "llama3.1" and self.rope_use_scale

  @property
  def preference_loss(self) -> str:
    """The preference loss's key set (use_dpo, use_orpo, use_simpo or use_kto; config_rules allows one), or ""."""
    return next((key for key in PREFERENCE_KEYS if getattr(self, key)), "")

  @property
  def schedule_steps(self) -> int:
    """The steps the learning-rate schedule spans: learning_rate_schedule_steps, or steps when -1."""
    return self.steps if self.learning_rate_schedule_steps == -1 else self.learning_rate_schedule_steps

  def replace(self, **changes: Any) -> Config:
    """A new Config with `changes` applied and validated."""
    config_keys.check_known(changes, _FIELD_TYPES, source="replace()")
    return dataclasses.replace(self, **changes)

  def to_dict(self) -> dict[str, Any]:
    return {name: getattr(self, name) for name in _FIELD_TYPES}

  def to_yaml(self, path: str | os.PathLike[str]) -> None:
    """Write every key to `path`; a reader never sees a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    files.write_text(path, yaml.safe_dump(self.to_dict(), sort_keys=False))


# Resolved once: get_type_hints evaluates every annotation string of the class, ~3 ms a call.
_HINTS = typing.get_type_hints(Config)
_FIELD_TYPES: dict[str, type] = {f.name: _HINTS[f.name] for f in dataclasses.fields(Config)}

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
  elif kind == tuple[int, ...]:
    return _int_list(key, value)
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


def _int_list(key: str, value: Any) -> tuple[int, ...]:
  """[0, 3] (a list, or its YAML text) -> (0, 3); null, "None" (MaxText's spelling), "" or [] -> ()."""
  if isinstance(value, str):
    try:
      value = None if value.strip() in ("", "None") else yaml.safe_load(value)
    except yaml.YAMLError as e:
      raise ConfigError(f"config key {key!r} is not valid YAML: {e}") from e
  if value is None:
    return ()
  if isinstance(value, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in value):
    return tuple(value)
  raise ConfigError(f"config key {key!r} expects a list of integers such as [0, 3] (or null), got {value!r}")


# libyaml's parser where PyYAML has it (SafeLoader's constructor either way): the pure-Python one took ~40 ms of
# every load_config, which every command and test calls.
class _UniqueKeyLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
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


def base_values() -> dict[str, Any]:
  """base.yml's value of every key (a new dict each call)."""
  return _read_yaml(BASE_CONFIG)


def _parse_override(text: str) -> tuple[str, str]:
  # The value stays a string: _coerce converts it by the key's declared type,
  # so `remat_policy=none` stays the string 'none' and `run_name=123` a name.
  key, sep, value = text.partition("=")
  if not sep or not key.strip():
    raise ConfigError(f"override {text!r} is not of the form key=value")
  return key.strip(), value.strip()


def override_values(overrides) -> dict[str, str]:
  """`key=value` overrides as {key: value string}, the last of a key winning, as `load_config` applies them."""
  return dict(map(_parse_override, overrides))


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
  values = base_values()
  if set(values) != set(_FIELD_TYPES):
    # Guards the promise that base.yml documents every key.
    drift = sorted(set(values) ^ set(_FIELD_TYPES))
    raise ConfigError(f"{BASE_CONFIG} and Config disagree on keys: {drift}")

  path = _resolve(preset_or_path)
  raw, given = _read_yaml(path), override_values(overrides)
  # The decoder_block the config will have: some MaxText keys' accepted value is its family's.
  block = str(kwargs.get("decoder_block", given.get("decoder_block", raw.get("decoder_block", values["decoder_block"]))))
  model = config_keys.known_only(raw, _FIELD_TYPES, source=str(path), decoder_block=block)
  values.update(model)
  values.update(config_keys.known_only(given, _FIELD_TYPES, source="overrides", decoder_block=block))
  values.update(config_keys.known_only(kwargs, _FIELD_TYPES, source="keyword arguments", decoder_block=block))
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
