import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from maxbridge.core import config_keys
from maxbridge.core.config import BASE_CONFIG, Config, ConfigError, available_presets, load_config


def test_base_yml_declares_every_config_field():
  keys = set(yaml.safe_load(BASE_CONFIG.read_text()))
  assert keys == {f.name for f in dataclasses.fields(Config)}


def test_preset_loads_with_its_dims():
  cfg = load_config("llama-tiny")
  assert cfg.model_name == "llama-tiny"
  assert (cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads) == (64, 4, 2)
  assert (cfg.head_dim, cfg.mlp_dim, cfg.num_decoder_layers) == (16, 128, 2)
  assert (cfg.vocab_size, cfg.max_target_length) == (256, 64)


def test_every_preset_is_valid():
  assert {"llama-tiny", "llama-small", "llama2-7b"} <= set(available_presets())
  for name in available_presets():
    assert load_config(name).model_name == name


def test_llama2_7b_has_real_dims():
  cfg = load_config("llama2-7b")
  assert (cfg.emb_dim, cfg.num_query_heads, cfg.num_kv_heads, cfg.head_dim) == (4096, 32, 32, 128)
  assert (cfg.mlp_dim, cfg.num_decoder_layers, cfg.vocab_size) == (11008, 32, 32000)


def test_overrides_are_typed_and_kwargs_win_over_strings():
  cfg = load_config("llama-tiny", "steps=20", "learning_rate=1e-5", "scan_layers=false", "pure_nnx=NO", steps=30)
  assert cfg.steps == 30 and type(cfg.steps) is int
  assert cfg.learning_rate == 1e-5 and type(cfg.learning_rate) is float
  assert cfg.scan_layers is False
  assert cfg.pure_nnx is False  # base.yml's default is true


def test_nnx_is_the_default_backend_as_in_maxtext():
  cfg = load_config("llama-tiny")
  assert (cfg.pure_nnx, cfg.enable_nnx, cfg.pure_nnx_decoder) == (True, True, True)


def test_later_string_override_wins_over_earlier_and_preset():
  cfg = load_config("llama-tiny", "base_emb_dim=32", "base_emb_dim=128")
  assert cfg.base_emb_dim == 128


def test_string_fields_keep_none_as_a_word():
  assert load_config("llama-tiny", "remat_policy=none").remat_policy == "none"
  assert load_config("llama-tiny", "remat_policy=full").remat_policy == "full"


def test_int_is_accepted_for_float_field():
  cfg = load_config("llama-tiny", learning_rate=1)
  assert cfg.learning_rate == 1.0 and type(cfg.learning_rate) is float


def test_unknown_key_names_it_and_suggests_the_closest():
  with pytest.raises(ConfigError, match="unknown config key 'base_emb_dims'; did you mean 'base_emb_dim'"):
    load_config("llama-tiny", "base_emb_dims=32")
  with pytest.raises(ConfigError, match="unknown config key 'pure_nnx_decodr'; did you mean 'pure_nnx_decoder'"):
    load_config("llama-tiny", pure_nnx_decodr=True)


def test_override_without_equals_is_rejected():
  with pytest.raises(ConfigError, match="'steps' is not of the form key=value"):
    load_config("llama-tiny", "steps")


@pytest.mark.parametrize(
    "override, key",
    [("base_emb_dim=abc", "base_emb_dim"), ("scan_layers=maybe", "scan_layers"), ("adam_b1=high", "adam_b1")],
)
def test_wrong_type_names_the_key_and_value(override, key):
  value = override.split("=")[1]
  with pytest.raises(ConfigError, match=f"'{key}' expects .*'{value}'"):
    load_config("llama-tiny", override)


def test_bool_is_not_an_int():
  with pytest.raises(ConfigError, match="'steps' expects int"):
    load_config("llama-tiny", steps=True)


def test_heads_not_dividing_names_base_num_query_heads():
  with pytest.raises(ConfigError, match="base_num_query_heads=6 must be a multiple of base_num_kv_heads=4"):
    load_config("llama-tiny", base_num_query_heads=6, base_num_kv_heads=4)


@pytest.mark.parametrize("key", ["base_emb_dim", "head_dim", "vocab_size", "base_num_decoder_layers"])
def test_non_positive_size_names_the_key(key):
  with pytest.raises(ConfigError, match=f"'{key}' = -1 is invalid; it must be a positive integer"):
    load_config("llama-tiny", **{key: -1})


def test_bad_remat_policy_lists_valid_ones():
  with pytest.raises(ConfigError, match="'remat_policy' = 'some'.*'none', 'full', 'minimal'"):
    load_config("llama-tiny", "remat_policy=some")


@pytest.mark.parametrize(
    "override, match",
    [
        ("dtype=float16", "'dtype'.*'float32', 'bfloat16'"),
        ("attention=cudnn_flash_te", "'attention' = 'cudnn_flash_te'.*'autoselected', 'dot_product', 'flash'"),
        ("param_scan_axis=2", "'param_scan_axis'.*0, 1"),
        ("normalization_layer_epsilon=0", "'normalization_layer_epsilon'.*> 0"),
        ("learning_rate=-1e-3", "'learning_rate'.*>= 0"),
        ("gradient_accumulation_steps=0", "'gradient_accumulation_steps'.*positive"),
        ("dataset_type=parquet", "'dataset_type'.*'embedded', 'synthetic', 'text'"),
        ("dataset_type=text", "dataset_type='text' needs dataset_path"),
        ("seed=-1", r"'seed' = -1 is invalid; it must be an integer in \[0, 2\*\*32\)"),
        # Module 63 of a 64-token sequence would predict nothing (and 100 took minutes to compile).
        ("mtp_num_layers=100", "mtp_num_layers=100 exceeds max_target_length - 2 = 62"),
    ],
)
def test_impossible_values_name_the_key_and_what_is_valid(override, match):
  with pytest.raises(ConfigError, match=match):
    load_config("llama-tiny", override)


def test_config_is_frozen():
  cfg = load_config("llama-tiny")
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.steps = 5


def test_replace_returns_a_new_validated_config():
  cfg = load_config("llama-tiny")
  changed = cfg.replace(steps="7", pure_nnx="false")
  assert (changed.steps, changed.pure_nnx) == (7, False)
  assert cfg.steps == 200
  with pytest.raises(ConfigError, match="'base_num_kv_heads' = 0"):
    cfg.replace(base_num_kv_heads=0)
  with pytest.raises(ConfigError, match="did you mean 'steps'"):
    cfg.replace(step=3)


def test_to_yaml_round_trips(tmp_path):
  cfg = load_config("llama-small", "learning_rate=1e-4", "pure_nnx=false", run_name="round-trip")
  path = tmp_path / "run" / "config.yml"
  cfg.to_yaml(path)
  assert load_config(str(path)) == cfg
  assert [p.name for p in path.parent.iterdir()] == ["config.yml"]  # no temp file left behind


def test_loading_from_a_yaml_path_applies_its_keys_over_base(tmp_path):
  path = tmp_path / "mine.yml"
  path.write_text("model_name: mine\nbase_emb_dim: 96\nadam_eps: 1e-6\n")
  cfg = load_config(str(path), "steps=3")
  assert (cfg.model_name, cfg.base_emb_dim, cfg.adam_eps, cfg.steps) == ("mine", 96, 1e-6, 3)
  assert cfg.seed == 0  # untouched keys keep base.yml's default


def test_unknown_key_in_yaml_file_names_the_file(tmp_path):
  path = tmp_path / "typo.yml"
  path.write_text("scan_layer: false\n")
  with pytest.raises(ConfigError, match=f"did you mean 'scan_layers'.*{path.name}"):
    load_config(str(path))


def test_missing_yaml_file_is_reported(tmp_path):
  with pytest.raises(ConfigError, match="does not exist"):
    load_config(str(tmp_path / "nope.yml"))


def test_unknown_preset_lists_available_ones():
  with pytest.raises(ConfigError, match="unknown preset 'llama-huge'; available presets: .*llama-tiny"):
    load_config("llama-huge")


def test_maxtext_names_for_our_keys_are_read_as_ours_or_refused_naming_ours():
  assert load_config("llama-tiny", "max_num_checkpoints_to_keep=5").max_to_keep == 5
  assert load_config("llama-tiny", max_num_checkpoints_to_keep=7).max_to_keep == 7
  with pytest.raises(ConfigError, match="'max_num_checkpoints_to_keep' \\(MaxText's name for 'max_to_keep'\\)"):
    load_config("llama-tiny", "max_num_checkpoints_to_keep=5", "max_to_keep=4")
  with pytest.raises(ConfigError, match="'init_weights_seed' is not supported; set seed"):
    load_config("llama-tiny", "init_weights_seed=3")


@pytest.mark.parametrize(
    "overrides, error",
    [
        (
            ["decode_sampling_strategy=weighted", "decode_sampling_temperature=0"],
            "decode_sampling_temperature, which is 0",
        ),
        (["decode_sampling_strategy=topk", "decode_sampling_temperature=0"], "decode_sampling_temperature, which is 0"),
        (["decode_sampling_strategy=topk"], r"in \[1, vocab_size=256\], got 0"),
        (["decode_sampling_strategy=topk", "decode_sampling_top_k=257"], r"in \[1, vocab_size=256\], got 257"),
        (["decode_sampling_strategy=nucleus"], r"set it in \(0, 1\]"),
    ],
)
def test_a_sampling_value_its_strategy_cannot_use_is_refused_not_decoded_greedily(overrides, error):
  with pytest.raises(ConfigError, match=error):
    load_config("llama-tiny", *overrides)
  # The same keys are fine where the strategy does not read them (greedy reads none).
  load_config("llama-tiny", "decode_sampling_temperature=0", "decode_sampling_top_k=0")


MODEL_FAMILIES = "# --- model families (MaxText names; each preset in models/ sets its own) ---"


def test_every_key_of_the_model_sections_is_fixed_on_resume_or_said_not_to_change_the_model():
  # A new model key must be classified: a resume that changes it is refused (MODEL_KEYS), or it is named as one
  # that changes how the model runs, not what it computes (HOW_NOT_WHAT).
  text, section, keys = Path(BASE_CONFIG).read_text(), None, []
  for line in text.splitlines():
    if line.startswith("# ---"):
      section = line
    elif section in ("# --- model ---", MODEL_FAMILIES) and (found := re.match(r"^([a-z_0-9]+):", line)):
      keys.append(found.group(1))
  assert len(keys) > 60
  assert not [k for k in keys if (k in config_keys.MODEL_KEYS) == (k in config_keys.HOW_NOT_WHAT)]
