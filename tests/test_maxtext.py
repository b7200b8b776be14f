"""MaxText users move in: its checkpoints (no config.yml beside them) and the config keys it uses."""

import re

import chex
import jax
import numpy as np
import pytest
import yaml
from flax import nnx

import converters
import maxbridge as mb
from maxbridge.core import canonical, checkpointing
from maxbridge import cli
from maxbridge.training import optimizers
from maxbridge.core.config import ConfigError
from maxbridge.interop.hf import HFError
from maxbridge.training.initial import initial_state
from maxbridge.training import recipe
from conftest import tiny_config

LINEN = (False, False, False)
NNX = (True, True, True)
BACKENDS = {"linen": LINEN, "nnx": NNX}
RUN = dict(per_device_batch_size=2, eval_interval=0, log_period=100)


def _save(directory, tree, step=3):
  ckpt = checkpointing.Checkpointer(directory)
  ckpt.save(step, tree)
  ckpt.wait()
  ckpt.close()
  return directory / str(step)


@pytest.fixture(scope="module")
def maxtext(tmp_path_factory):
  """Checkpoints as MaxText writes them, made by our own code, with no config.yml:
  {name: (step folder, canonical params)} in the linen layout scanned and unscanned, and the nnx layout."""
  root = tmp_path_factory.mktemp("maxtext")
  found = {}
  for name, flags, scanned in (("linen-scanned", LINEN, True), ("linen-unscanned", LINEN, False), ("nnx", NNX, False)):
    trainer = recipe.create_trainer(tiny_config(flags, scan_layers=scanned))
    state = trainer.init_state(7)
    tree = trainer.to_checkpoint(state) if flags == LINEN else nnx.to_pure_dict(state)
    found[name] = (_save(root / name, tree), jax.device_get(trainer.params(state)))
  assert not list(root.rglob("config.yml"))
  return found


MODELS = {}


def _reference_logits(flags, params, tokens):
  """`Model.load_params` of `params` on a fresh model of `flags`, the reference every loader must equal."""
  if flags not in MODELS:
    MODELS[flags] = mb.create_model(tiny_config(flags))
  MODELS[flags].load_params(params)
  return np.asarray(MODELS[flags].logits(tokens))


@pytest.mark.parametrize(
    "backend,name",
    [("linen", "linen-scanned"), ("nnx", "linen-scanned"), ("linen", "linen-unscanned"), ("nnx", "nnx")],
)
def test_from_pretrained_with_a_config_matches_load_params(maxtext, tokens, backend, name):
  step_dir, params = maxtext[name]
  path = step_dir / "items" if name == "linen-scanned" else step_dir  # MaxText's keys take either
  model = mb.from_pretrained(path, backend=backend, config="llama-tiny")
  assert model.config.pure_nnx == (backend == "nnx") and model.config.scan_layers
  np.testing.assert_allclose(model.logits(tokens), _reference_logits(BACKENDS[backend], params, tokens), atol=1e-6)


def test_from_pretrained_takes_a_yaml_config_and_overrides(maxtext, tokens, tmp_path):
  step_dir, params = maxtext["linen-scanned"]
  yml = tmp_path / "mine.yml"
  mb.load_config("llama-tiny").to_yaml(yml)
  model = mb.from_pretrained(step_dir, backend="linen", config=str(yml), scan_layers=False)
  assert not model.config.scan_layers
  np.testing.assert_allclose(model.logits(tokens), _reference_logits(LINEN, params, tokens), atol=1e-6)


def test_a_checkpoint_without_config_says_how_to_pass_one(maxtext, tmp_path, capsys):
  step_dir, _ = maxtext["nnx"]
  with pytest.raises(HFError, match=r"no config.yml.*config='llama2-7b'.*--config llama2-7b"):
    mb.from_pretrained(step_dir)
  assert cli.main(["export-hf", str(step_dir), str(tmp_path / "no")]) == 2
  assert "--config" in capsys.readouterr().err and not (tmp_path / "no").exists()
  assert cli.main(["export-hf", str(step_dir), str(tmp_path / "hf"), "--config", "llama-tiny"]) == 0
  assert (tmp_path / "hf" / "config.json").is_file()


def test_a_config_that_does_not_describe_the_checkpoint_is_named_in_the_error(maxtext, capsys):
  step_dir, _ = maxtext["nnx"]
  with pytest.raises(HFError, match=r"config='llama-small' does not describe the checkpoint in .*decoder_norm/scale"):
    mb.from_pretrained(step_dir, config="llama-small")
  assert cli.main(["generate", str(step_dir), "--config", "llama-small", "--max-new-tokens", "1"]) == 2
  assert "config='llama-small' does not describe the checkpoint" in capsys.readouterr().err


def test_a_wrong_config_is_reported_from_the_metadata_before_any_array_is_read(maxtext, monkeypatch):
  step_dir, _ = maxtext["nnx"]
  reads, read = [], checkpointing.CheckpointReader.read
  monkeypatch.setattr(
      checkpointing.CheckpointReader, "read", lambda self, normal: reads.append(normal) or read(self, normal)
  )
  with pytest.raises(HFError, match="config='llama-small' does not describe the checkpoint"):
    mb.from_pretrained(step_dir, config="llama-small")
  assert reads == []
  mb.from_pretrained(step_dir, backend="linen", config="llama-tiny")
  assert "params/params/decoder/decoder_norm/scale" in reads


def test_convert_with_a_config_writes_it_beside_the_result(maxtext, tokens, tmp_path):
  step_dir, params = maxtext["nnx"]
  with pytest.raises(converters.ConversionError, match="does not describe the checkpoint"):
    converters.convert(step_dir, tmp_path / "wrong", config="llama2-7b")
  assert not (tmp_path / "wrong").exists()
  assert cli.main(["convert", str(step_dir), str(tmp_path / "ours"), "--layout", "linen", "--config", "llama-tiny"]) == 0
  assert not mb.load_config(str(tmp_path / "ours" / "config.yml")).scan_layers  # as the source is stored
  model = mb.from_pretrained(tmp_path / "ours", backend="nnx")  # no config= needed now
  np.testing.assert_allclose(model.logits(tokens), _reference_logits(NNX, params, tokens), atol=1e-6)


def test_generate_reads_a_maxtext_checkpoint_by_config_or_load_parameters_path(maxtext, capsys):
  step_dir, _ = maxtext["linen-unscanned"]
  common = ["--prompt", "ab", "--max-new-tokens", "4", "--backend", "linen"]
  outputs = []
  for argv in (
      ["generate", str(step_dir), "--config", "llama-tiny", *common],
      ["generate", "llama-tiny", f"load_parameters_path={step_dir}", *common],
      ["generate", "llama-tiny", *common],  # random parameters: a different continuation
  ):
    assert cli.main(argv) == 0
    outputs.append(capsys.readouterr().out)
  assert outputs[0] == outputs[1] != outputs[2]


@pytest.mark.parametrize("backend,name", [("linen", "linen-unscanned"), ("nnx", "nnx")])
def test_load_parameters_path_starts_a_new_run_from_those_parameters(maxtext, tokens, tmp_path, backend, name):
  step_dir, params = maxtext[name]
  flags = BACKENDS[backend]
  config = tiny_config(flags, load_parameters_path=str(step_dir / "items" if backend == "nnx" else step_dir))
  trainer = recipe.create_trainer(config)
  state = initial_state(config, trainer)
  assert trainer.step(state) == 0
  started = jax.device_get(trainer.params(state))
  chex.assert_trees_all_equal(started, jax.device_get(canonical.conform(params, trainer.abstract_params, 1)))
  np.testing.assert_array_equal(_reference_logits(flags, started, tokens), _reference_logits(flags, params, tokens))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """A 6-step Linen run checkpointed at step 3, and its losses."""
  root = tmp_path_factory.mktemp("full")
  config = tiny_config(LINEN, base_output_directory=str(root), run_name="a", steps=6, checkpoint_period=3, **RUN)
  return root / "a" / "checkpoints" / "3", [r["loss"] for r in mb.train(config, progress=False)]


@pytest.mark.parametrize(
    "backend,scan_layers", [("linen", True), ("nnx", True), ("nnx", False)], ids=["linen", "nnx", "nnx-unscanned"]
)
def test_load_full_state_path_continues_the_optimizer_exactly(uninterrupted, tmp_path, backend, scan_layers):
  step_dir, losses = uninterrupted
  path = step_dir if scan_layers else step_dir / "items"
  config = tiny_config(
      BACKENDS[backend],
      base_output_directory=str(tmp_path),
      run_name="b",
      steps=6,
      scan_layers=scan_layers,
      load_full_state_path=str(path),
      **RUN,
  )
  records = mb.train(config, progress=False)
  assert [r["step"] for r in records] == [3, 4, 5]
  np.testing.assert_allclose([r["loss"] for r in records], losses[3:], rtol=1e-6)


def test_a_run_with_its_own_checkpoints_ignores_the_load_keys(uninterrupted, tmp_path):
  step_dir, _ = uninterrupted
  missing = str(tmp_path / "nowhere")
  # A path that would fail if it were read: the run resumes from its own last step (6) instead.
  again = tiny_config(LINEN, base_output_directory=str(step_dir.parents[2]), run_name="a", steps=6, **RUN)
  assert mb.train(again.replace(load_full_state_path=missing), progress=False) == []
  assert mb.train(again.replace(load_parameters_path=missing), progress=False) == []
  new = again.replace(run_name="new", load_parameters_path=missing)
  with pytest.raises(checkpointing.CheckpointError, match=r"load_parameters_path=.*nowhere.*no such file"):
    initial_state(new, recipe.create_trainer(new))


def test_load_full_state_path_refuses_a_params_only_checkpoint(tmp_path):
  _save(tmp_path / "p", {"params": {"params": mb.create_model(tiny_config()).params()}}, step=0)
  config = tiny_config(LINEN, load_full_state_path=str(tmp_path / "p" / "0"))
  with pytest.raises(checkpointing.CheckpointError, match="parameters only.*load_parameters_path"):
    initial_state(config, recipe.create_trainer(config))


def test_learning_rate_schedule_steps_plans_the_schedule_past_steps():
  planned = optimizers.learning_rate_schedule(tiny_config(steps=6, learning_rate_schedule_steps=12))
  whole = optimizers.learning_rate_schedule(tiny_config(steps=12))
  short = optimizers.learning_rate_schedule(tiny_config(steps=6))
  np.testing.assert_array_equal([planned(s) for s in range(12)], [whole(s) for s in range(12)])
  assert not np.allclose([planned(s) for s in range(6)], [short(s) for s in range(6)])


def test_stopping_at_step_6_of_a_12_step_schedule_and_resuming_equals_the_whole_run(tmp_path):
  common = dict(base_output_directory=str(tmp_path), checkpoint_period=6, **RUN)
  config = tiny_config(run_name="whole", steps=12, **common)
  trainer = recipe.create_trainer(config)  # compiled once for the whole run and the resumed one
  whole = mb.train(config, trainer=trainer, progress=False)
  head = mb.train(tiny_config(run_name="split", steps=6, learning_rate_schedule_steps=12, **common), progress=False)
  tail = mb.train(config.replace(run_name="split"), trainer=trainer, progress=False)
  assert [r["step"] for r in head + tail] == list(range(12))
  for key in ("loss", "lr"):
    np.testing.assert_allclose([r[key] for r in head + tail], [r[key] for r in whole], rtol=1e-6, err_msg=key)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(learning_rate_schedule_steps=0), "'learning_rate_schedule_steps' = 0 is invalid.*-1 for steps"),
        (dict(load_parameters_path="a", load_full_state_path="b"), "load_parameters_path and load_full_state_path"),
    ],
)
def test_bad_maxtext_keys_are_named(overrides, message):
  with pytest.raises(ConfigError, match=message):
    tiny_config(**overrides)


def test_model_name_names_the_preset():
  assert mb.load_config(model_name="llama-tiny", steps=3) == mb.load_config("llama-tiny", steps=3)
  assert mb.load_config(None, "model_name=llama-tiny").model_name == "llama-tiny"
  with pytest.raises(ConfigError, match="model_name=<preset>"):
    mb.load_config()
  args = cli.parse_args(["train", "model_name=llama-tiny", "steps=2"])
  assert args.preset == "llama-tiny" and "steps=2" in args.overrides


def test_override_model_config_guards_a_preset_named_by_model_name(capsys):
  # MaxText's rule for its spelling: the model's own keys are fixed unless override_model_config=true.
  with pytest.raises(ConfigError, match=r"sets base_emb_dim=64 \(given 96\).*override_model_config=true"):
    mb.load_config(model_name="llama-tiny", base_emb_dim=96)
  assert cli.main(["train", "model_name=llama-tiny", "head_dim=8"]) == 2
  assert "sets head_dim=16 (given '8')" in capsys.readouterr().err
  assert mb.load_config(model_name="llama-tiny", base_emb_dim=96, override_model_config=True).base_emb_dim == 96
  # Same values, run keys (steps, max_target_length) and the positional preset stay free.
  assert mb.load_config(model_name="llama-tiny", base_emb_dim=64, max_target_length=32, steps=2).steps == 2
  assert mb.load_config("llama-tiny", base_emb_dim=96).base_emb_dim == 96


MAXTEXT_YAML = """\
model_name: llama-tiny
base_emb_dim: 64
enable_tensorboard: true
metrics_file: "metrics.txt"
mlp_activations: ["silu", "linear"]
"""


def test_a_maxtext_yaml_reports_each_ignored_key_by_name(tmp_path):
  path = tmp_path / "maxtext.yml"
  path.write_text(MAXTEXT_YAML)
  with pytest.warns(UserWarning) as caught:
    config = mb.load_config(str(path), "global_parameter_scale=1")
  assert [str(w.message).split(": ", 1)[1] for w in caught] == [
      "enable_tensorboard, metrics_file, mlp_activations",
      "global_parameter_scale",
  ]
  assert all(str(w.message).startswith("ignoring MaxText config keys") for w in caught)
  assert config.base_emb_dim == 64


def test_a_maxtext_yaml_with_keys_that_change_the_numbers_is_refused_key_by_key(tmp_path):
  path = tmp_path / "maxtext.yml"
  path.write_text(
      MAXTEXT_YAML + "mlp_activations_extra: 1\nfused_qkv: true\nfloat32_qk_product: true\ndropout_rate: 0.1\n"
  )
  with pytest.raises(ConfigError) as error:
    mb.load_config(str(path))
  message = str(error.value)
  assert "4 config keys are not supported" in message, message
  for line in (
      "unknown config key 'mlp_activations_extra'",
      "MaxText key 'fused_qkv' = True is not supported; maxbridge computes only fused_qkv=False",
      "unknown config key 'float32_qk_product'",
      "MaxText key 'dropout_rate' = 0.1 is not supported",
  ):
    assert line in message, message
  with pytest.raises(ConfigError, match="'global_parameter_scale' = '2' is not supported"):
    mb.load_config("llama-tiny", "global_parameter_scale=2")


def test_a_config_that_contradicts_the_runs_own_is_refused_by_every_reader(maxtext, tmp_path, capsys):
  """Same shapes, another RoPE base: read with it, the checkpoints would be another model. A config that agrees
  on what the model computes is taken (its precision here)."""
  step_dir, _ = maxtext["nnx"]
  ours = tmp_path / "ours"
  assert cli.main(["convert", str(step_dir), str(ours), "--layout", "linen", "--config", "llama-tiny"]) == 0
  other = tmp_path / "other.yml"
  other.write_text(yaml.safe_dump(mb.load_config("llama-tiny", rope_max_timescale=500000).to_dict()))
  said = r"rope_max_timescale: 10000 -> 500000"
  with pytest.raises(HFError, match=rf"config='{other}' contradicts {ours}/config.yml.*{said}"):
    mb.from_pretrained(ours, config=str(other))
  assert cli.main(["generate", str(ours), "--config", str(other), "--max-new-tokens", "1"]) == 2
  assert re.search(said, capsys.readouterr().err)
  with pytest.raises(converters.ConversionError, match=rf"--config {other} contradicts the source's config.yml.*{said}"):
    converters.convert(ours, tmp_path / "again", config=str(other))
  assert not (tmp_path / "again").exists()
  agrees = tmp_path / "agrees.yml"
  agrees.write_text(yaml.safe_dump(mb.load_config("llama-tiny", scan_layers=False, dtype="bfloat16").to_dict()))
  assert mb.from_pretrained(ours, backend="linen", config=str(agrees)).config.dtype == "bfloat16"
