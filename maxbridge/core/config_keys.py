"""Which keys a config may hold: ours, and MaxText's that a MaxText YAML carries (ignored, fixed, renamed or refused).

`load_config` reads every YAML file, override and keyword through `known_only`; `Config.replace` checks its keys
with `check_known`. An unknown key is an error naming the closest valid one.
"""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Collection, Mapping
from typing import Any

import yaml

from maxbridge.core import families
from maxbridge.core.config_rules import ConfigError

# Config's key names are passed in (`keys`): Config reads its keys through this module, so it cannot import it.


def check_known(values: Mapping[str, Any], keys: Collection[str], source: str) -> None:
  """Raise ConfigError for the first key of `values` not among `keys`, naming the closest valid one."""
  for key in values:
    if key not in keys:
      raise ConfigError(f"{_unknown(key, keys)} (from {source})")


def _unknown(key: Any, keys: Collection[str]) -> str:
  close = difflib.get_close_matches(str(key), keys, n=1)
  hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(keys)}"
  return f"unknown config key {key!r}; {hint}"


# Keys of base.yml's model sections that change how the model runs or is stored, its label or its training, not
# what it computes: free on resume (the layout keys, scan_layers and param_scan_axis, are fixed as such).
HOW_NOT_WHAT = frozenset(
    {
        *("model_name", "override_model_config", "max_target_length", "dtype", "weight_dtype"),
        *("scan_layers", "param_scan_axis", "remat_policy", "attention", "float32_logits", "sparse_matmul"),
        *("gdn_chunk_size", "pure_nnx", "enable_nnx", "pure_nnx_decoder", "seed", "load_balance_loss_weight"),
        *("sa_block_q", "sa_block_kv", "sa_block_kv_compute", "sa_block_q_dkv", "sa_block_kv_dkv"),
        *("sa_block_kv_dkv_compute", "sa_block_q_dq", "sa_block_kv_dq", "sa_use_fused_bwd_kernel"),
        *("sa_q_layout", "sa_k_layout", "sa_v_layout"),
    }
)


# What a model computes: the keys of base.yml's model sections and every family's own (`Family.own_keys`), less
# `HOW_NOT_WHAT`. A resume may not change them (`recipe.FIXED_KEYS`): config.yml, which every reader (generate,
# serve, export-hf, from_pretrained) rebuilds the model from, keeps the values the run started with.
MODEL_KEYS: tuple[str, ...] = tuple(
    dict.fromkeys(
        (
            "decoder_block",
            *("base_emb_dim", "base_num_query_heads", "base_num_kv_heads", "head_dim", "base_mlp_dim"),
            *("base_num_decoder_layers", "vocab_size", "normalization_layer_epsilon"),
            *("rope_max_timescale", "rope_type", "rope_use_scale", "rope_factor", "rope_low_freq_factor"),
            *("rope_high_freq_factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "rope_truncate"),
            *("rope_attention_scaling", "mscale", "local_rope_max_timescale", "rope_linear_scaling_factor"),
            *("logits_via_embedding", "normalize_embedding_logits"),
            *("sliding_window_size", "use_qk_norm", "attn_logits_soft_cap", "final_logits_soft_cap"),
            *("query_pre_attn_scalar", "trainable_position_size", "num_experts", "num_experts_per_tok", "moe_mlp_dim"),
            *("shared_experts", "routed_score_func", "routed_bias", "routed_scaling_factor", "norm_topk_prob"),
            *("mlp_activations_limit", "n_routing_groups", "topk_routing_group", "first_num_dense_layers"),
            *("chunk_attn_window_size", "nope_layer_interval", "interleave_moe_layer_step", "temperature_tuning"),
            *("temperature_tuning_scale", "temperature_tuning_floor_scale", "global_head_dim", "global_num_kv_heads"),
            *("global_rope_proportion", "share_kv_projections", "hidden_size_per_layer_input"),
            *(
                "num_kv_shared_layers",
                "use_double_wide_mlp",
                "q_lora_rank",
                "kv_lora_rank",
                "qk_nope_head_dim",
                "qk_rope_head_dim",
            ),
            *("v_head_dim", "partial_rotary_factor", "gdn_num_key_heads", "gdn_num_value_heads", "gdn_key_head_dim"),
            *("gdn_value_head_dim", "gdn_conv_kernel_dim"),
            *("use_multimodal", "image_size_for_vit", "num_channels_for_vit", "patch_size_for_vit"),
            *("conv_stride_for_vit", "hidden_size_for_vit", "intermediate_size_for_vit", "num_hidden_layers_for_vit"),
            *("num_attention_heads_for_vit", "vision_output_length", "normalization_layer_epsilon_for_vit"),
            *("image_token_index", "boi_token_index", "eoi_token_index"),
            *(key for family in families.REGISTRY for key in family.own_keys if key not in HOW_NOT_WHAT),
        )
    )
)


def contradictions(saved: Any, given: Any) -> list[str]:
  """The keys of what a model computes (`MODEL_KEYS`) on which two configs differ, each with both values: a
  config given for a checkpoint whose run has its own config.yml must agree with it on these."""
  return [
      f"{key}: {getattr(saved, key, None)!r} -> {getattr(given, key, None)!r}"
      for key in MODEL_KEYS
      if yaml.safe_dump(getattr(saved, key, None)) != yaml.safe_dump(getattr(given, key, None))
  ]


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
        "enable_dropout",  # dropout_rate is fixed at 0 here, so there is no dropout to switch
        "context_parallel_load_balance",  # where each token's attention runs, not what it computes
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
    "dcn_tensor_parallelism": 1,
    "ici_sequence_parallelism": 1,
    # MaxText's base.yml values; a family may fix others (`Family.maxtext_fixed`: Gemma's GeGLU, post-norms).
    "use_post_attn_norm": False,
    "use_post_ffw_norm": False,
    "attention_bias": False,  # biases on the query, key and value projections (qwen2's and gpt_oss's fix it true)
}


def _maxtext_fixed(key: str, decoder_block: str | None) -> Any:
  """The value maxbridge computes for MaxText key `key` with `decoder_block` (None: the default)."""
  fixed = _MAXTEXT_FIXED[key]
  if decoder_block in families.DECODER_BLOCKS:
    fixed = families.lookup(decoder_block).maxtext_fixed.get(key, fixed)
  return fixed


# MaxText's names for keys that maxbridge spells otherwise: read as maxbridge's key.
_MAXTEXT_RENAMED = {"max_num_checkpoints_to_keep": "max_to_keep", "base_moe_mlp_dim": "moe_mlp_dim"}
# MaxText keys that one maxbridge key covers together with another: refused, naming ours.
_ONE_SEED = (
    "seed (maxbridge's one seed sets both parameter init and data order; MaxText's "
    "init_weights_seed and data_shuffle_seed set one each)"
)
_MAXTEXT_MERGED = {"init_weights_seed": _ONE_SEED, "data_shuffle_seed": _ONE_SEED}


def known_only(
    values: Mapping[str, Any], keys: Collection[str], source: str, decoder_block: str | None = None
) -> dict[str, Any]:
  """`values` without MaxText's keys that do not change the numbers (each reported by name),
  MaxText's names for our keys renamed; any other key not among `keys` is an error, all of them named at once.

  `decoder_block`, the config's, decides the value of a key its family fixes (`Family.maxtext_fixed`)."""
  ignored, problems, renamed = [], [], {}
  for key, value in values.items():
    if key in keys:
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
      fixed = _maxtext_fixed(key, decoder_block)
      if parsed == fixed or (isinstance(fixed, list) and parsed == tuple(fixed)):
        ignored.append(key)
      else:
        problems.append(
            f"MaxText key {key!r} = {value!r} is not supported; maxbridge computes only {key}={fixed!r}"
            + (f" with decoder_block={decoder_block!r}" if decoder_block else "")
        )
    else:
      problems.append(_unknown(key, keys))
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
        stacklevel=3,  # load_config's caller: load_config calls this directly
    )
  return {**{key: value for key, value in values.items() if key in keys}, **renamed}
