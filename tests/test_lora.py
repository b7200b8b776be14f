"""LoRA on both backends: adapters train, the base stays bit-identical, every flag combination logs the same losses;
adapter checkpoints resume across backends and refuse another base; lora-merge -> export-hf matches transformers."""

import importlib
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from etils import epath
import orbax.checkpoint as ocp

import maxbridge as mb
from maxbridge import canonical, checkpointing, cli, data, dispatch, lora
from maxbridge.config import ConfigError
from conftest import flag_id, tiny_config

train_module = importlib.import_module("maxbridge.train")  # `maxbridge.train` the function shadows it

LINEN = (False, False, False)
NNX = (True, True, True)
LORA = dict(lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, per_device_batch_size=2, max_target_length=16)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(lora_rank=-1), r"'lora_rank' = -1 is invalid; it must be >= 0"),
        (dict(lora_alpha=0.0), r"'lora_alpha' = 0.0 is invalid; it must be > 0"),
        (dict(lora_module_path="decoder/(("), r"'lora_module_path' = 'decoder/\(\(' is not a regular expression"),
        (dict(lora_dropout=0.1), r"'lora_dropout' = 0.1 is not supported; valid values: 0.0"),
        (dict(lora_weight_qtype="nf4"), r"'lora_weight_qtype' = 'nf4' \(QLoRA\) is not built yet; valid values: ''"),
        (dict(lora_rank=4, use_qk_clip=True), r"lora_rank > 0 with use_qk_clip=true"),
    ],
)
def test_bad_lora_config_names_the_key(overrides, match):
  with pytest.raises(ConfigError, match=match):
    tiny_config(**overrides)


def test_a_module_path_matching_nothing_lists_the_kernels():
  with pytest.raises(ValueError, match=r"matches no kernel .* decoder/layers/mlp/wi_0/kernel"):
    dispatch.create_trainer(tiny_config(lora_rank=4, lora_module_path="decoder/layers_0/.*"))


def test_adapters_have_canonical_names_and_shapes():
  trainer = dispatch.create_trainer(tiny_config(NNX, **LORA, lora_module_path=r"decoder/layers/self_attention/.*"))
  flat = {p: x.shape for p, x in canonical.flatten(trainer.abstract_adapters).items()}
  # llama-tiny: emb 64, 4 query heads and 2 kv heads of 16, 2 layers stacked on axis 1; rank 4.
  assert flat == {
      "decoder/layers/self_attention/query/kernel_lora_a": (64, 2, 4),
      "decoder/layers/self_attention/query/kernel_lora_b": (4, 2, 4, 16),
      "decoder/layers/self_attention/key/kernel_lora_a": (64, 2, 4),
      "decoder/layers/self_attention/key/kernel_lora_b": (4, 2, 2, 16),
      "decoder/layers/self_attention/value/kernel_lora_a": (64, 2, 4),
      "decoder/layers/self_attention/value/kernel_lora_b": (4, 2, 2, 16),
      "decoder/layers/self_attention/out/kernel_lora_a": (4, 2, 16, 4),
      "decoder/layers/self_attention/out/kernel_lora_b": (4, 2, 64),
  }


# Bridged mixes: an NNX train state around a Linen top level and an NNX decoder, and the reverse.
MIXED = (True, False, True)
MIXED_LINEN = (False, True, False)
BACKENDS = [LINEN, NNX, MIXED, MIXED_LINEN]
STEPS = 4
# One config for the step tests and the runs, so that each backend's trainer compiles once (run keys aside).
RUN = dict(**LORA, steps=STEPS, eval_interval=0, checkpoint_period=2)


def _batches(config):
  dataset = data.make_dataset(config, "train", train_module.global_batch_size(config))
  return [dataset.batch(step, 0, 1) for step in range(STEPS)]


def _train(trainer):
  """(per-step losses, base before, base after, adapters after, checkpoint tree) of STEPS steps from seed 0."""
  state = trainer.init_state(0)
  before = jax.device_get(trainer.params(state))
  adapted = jax.device_get(trainer.adapted_params(state))
  losses = []
  for batch in _batches(trainer.config):
    state, metrics = trainer.train_step(state, trainer.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return dict(
      losses=losses,
      before=before,
      adapted=adapted,
      after=jax.device_get(trainer.params(state)),
      adapters=jax.device_get(trainer.adapters(state)),
      checkpoint=jax.device_get(trainer.to_checkpoint(state)),
  )


@pytest.fixture(scope="module")
def trainers():
  return {flags: dispatch.create_trainer(tiny_config(flags, **RUN)) for flags in BACKENDS}


@pytest.fixture(scope="module")
def runs(trainers):
  return {flags: _train(trainer) for flags, trainer in trainers.items()}


@pytest.fixture(scope="module")
def full_model_params():
  return canonical.flatten(mb.create_model(tiny_config(), seed=0).params())


@pytest.mark.parametrize("flags", BACKENDS, ids=map(flag_id, BACKENDS))
def test_lora_at_step_0_is_the_base_model_exactly(flags, runs, full_model_params):
  base, adapted = canonical.flatten(runs[flags]["before"]), canonical.flatten(runs[flags]["adapted"])
  # The base is the full model's initial parameters for the same seed, and the adapters change none of them.
  assert sorted(base) == sorted(adapted) == sorted(full_model_params)
  for path, leaf in full_model_params.items():
    np.testing.assert_array_equal(base[path], leaf, err_msg=path)
    np.testing.assert_array_equal(adapted[path], leaf, err_msg=path)


@pytest.mark.parametrize("flags", BACKENDS, ids=map(flag_id, BACKENDS))
def test_training_changes_only_the_adapters_and_logs_linen_losses(flags, runs):
  run = runs[flags]
  for path, leaf in canonical.flatten(run["before"]).items():
    np.testing.assert_array_equal(canonical.flatten(run["after"])[path], leaf, err_msg=f"base {path} changed")
  for path, leaf in canonical.flatten(run["adapters"]).items():
    if path.endswith("_lora_b"):
      assert np.abs(leaf).max() > 0, f"{path} never trained"
  np.testing.assert_allclose(run["losses"], runs[LINEN]["losses"], rtol=0, atol=1e-5, err_msg=flag_id(flags))
  assert run["losses"][-1] < run["losses"][0]


@pytest.mark.parametrize("flags", [LINEN, NNX], ids=["linen", "nnx"])
def test_the_optimizer_state_covers_the_adapters_only(flags, runs):
  tree = runs[flags]["checkpoint"]
  assert set(tree) == {"params", "opt_state", "step"}
  assert list(tree["params"]) == ["lora"]
  adapter_paths = set(canonical.flatten(tree["params"]["lora"]))
  adam = tree["opt_state"][0]
  assert set(canonical.flatten(adam["mu"]["lora"])) == adapter_paths == set(canonical.flatten(adam["nu"]["lora"]))
  assert int(tree["step"]) == STEPS


def test_unscanned_lora_logs_the_scanned_losses(runs):
  trainer = dispatch.create_trainer(tiny_config(NNX, **RUN, scan_layers=False))
  np.testing.assert_allclose(_train(trainer)["losses"], runs[LINEN]["losses"], rtol=0, atol=1e-5)


def test_remat_accumulation_and_vocab_tiling_with_an_adapted_head_match_across_backends():
  overrides = dict(
      remat_policy="full",
      gradient_accumulation_steps=2,
      per_device_batch_size=1,
      num_vocab_tiling=2,
      lora_module_path=r"decoder/(layers/(self_attention|mlp)/\w+|logits_dense)/kernel",
  )
  linen, nnx = (_train(dispatch.create_trainer(tiny_config(flags, **{**RUN, **overrides}))) for flags in (LINEN, NNX))
  assert "logits_dense" in linen["adapters"]["decoder"]
  np.testing.assert_allclose(nnx["losses"], linen["losses"], rtol=0, atol=1e-5)
  assert linen["losses"][-1] < linen["losses"][0]


# --- adapter checkpoints ----------------------------------------------------------------------------------


def _run_config(tmp_path, name, flags, **overrides):
  return tiny_config(flags, base_output_directory=str(tmp_path), run_name=name, **RUN, **overrides)


@pytest.fixture(scope="module")
def linen_run(tmp_path_factory, trainers):
  """An uninterrupted Linen LoRA run of STEPS steps: its config and losses."""
  config = _run_config(tmp_path_factory.mktemp("lora"), "linen", LINEN)
  records = mb.train(config, trainer=trainers[LINEN], progress=False)
  return config, [r["loss"] for r in records]


def test_checkpoints_hold_adapters_optimizer_state_step_and_the_base_reference(linen_run):
  config, _ = linen_run
  run_dir = train_module.run_directory(config)
  items = run_dir / "checkpoints" / str(STEPS) / "items"
  stored = ocp.PyTreeCheckpointHandler().metadata(epath.Path(items.absolute())).tree
  assert set(stored) == {"params", "opt_state", "step"}
  assert all(p.startswith("lora/") and "_lora_" in p for p in canonical.flatten(stored["params"]))
  reference = json.loads((run_dir / lora.REFERENCE_FILE).read_text())
  assert reference["base"] == "seed 0" and len(reference["fingerprint"]) == 24


@pytest.mark.parametrize("first,second", [(LINEN, NNX), (NNX, LINEN)], ids=["linen-to-nnx", "nnx-to-linen"])
def test_a_lora_run_resumes_on_the_other_backend(first, second, tmp_path, linen_run, trainers):
  _, reference = linen_run
  head = mb.train(_run_config(tmp_path, "run", first), trainer=trainers[first], until_step=2, progress=False)
  tail = mb.train(_run_config(tmp_path, "run", second), trainer=trainers[second], progress=False)
  assert [r["step"] for r in head + tail] == list(range(STEPS))
  np.testing.assert_allclose([r["loss"] for r in head + tail], reference, rtol=0, atol=1e-5)


def _save_base(path, seed):
  checkpointer = checkpointing.Checkpointer(path)
  checkpointer.save(0, {"params": {"params": jax.device_get(mb.create_model(tiny_config(), seed=seed).params())}})
  checkpointer.close()
  tiny_config().to_yaml(path / "config.yml")
  return str(path)


def test_resuming_on_another_base_is_refused_naming_both(tmp_path, trainers):
  first, second = _save_base(tmp_path / "base-a", 0), _save_base(tmp_path / "base-b", 7)
  mb.train(
      _run_config(tmp_path, "run", NNX, load_parameters_path=first), trainer=trainers[NNX], until_step=2, progress=False
  )
  with pytest.raises(checkpointing.CheckpointError, match=r"trained on base .*base-a .* this run's base is .*base-b"):
    mb.train(_run_config(tmp_path, "run", NNX, load_parameters_path=second), trainer=trainers[NNX], progress=False)


# --- merge and export ------------------------------------------------------------------------------------


def test_lora_merge_refuses_an_existing_destination_and_another_base(linen_run, tmp_path):
  config, _ = linen_run
  run_dir = str(train_module.run_directory(config))
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "file").write_text("mine")
  assert cli.main(["lora-merge", _save_base(tmp_path / "base", 0), run_dir, str(tmp_path / "taken")]) == 2
  assert (tmp_path / "taken" / "file").read_text() == "mine"
  with pytest.raises(checkpointing.CheckpointError, match=r"trained on base seed 0 .* not on .*other"):
    lora.merge_checkpoint(_save_base(tmp_path / "other", 7), run_dir, tmp_path / "merged")
  assert not (tmp_path / "merged").exists()


def test_merged_then_exported_model_matches_the_adapted_model_in_transformers(tmp_path):
  """import-hf -> LoRA training -> lora-merge -> export-hf: transformers computes the adapted model's logits."""
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  torch.manual_seed(0)
  dims = dict(hidden_size=64, num_hidden_layers=2, vocab_size=256, num_attention_heads=4, num_key_value_heads=2)
  hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dims, intermediate_size=128))
  hf_model.save_pretrained(tmp_path / "hf")
  assert cli.main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "base")]) == 0
  config = mb.load_config(
      str(tmp_path / "base" / "config.yml"),
      load_parameters_path=str(tmp_path / "base"),
      base_output_directory=str(tmp_path),
      run_name="lora",
      steps=STEPS,
      eval_interval=0,
      **LORA,
  )
  mb.train(config, progress=False)
  run_dir = tmp_path / "lora"
  assert cli.main(["lora-merge", str(tmp_path / "hf"), str(run_dir), str(tmp_path / "merged")]) == 0
  assert cli.main(["export-hf", str(tmp_path / "merged"), str(tmp_path / "exported")]) == 0

  # The adapted model as training runs it (the base with the adapters merged in), restored from the run.
  trainer = dispatch.create_trainer(config)
  checkpoints = checkpointing.Checkpointer(run_dir / "checkpoints", create=False)
  restored = checkpoints.restore(STEPS, trainer.checkpoint_target())
  checkpoints.close()
  state = trainer.with_checkpoint(train_module.initial_state(config, trainer), restored)
  adapted = trainer.adapted_params(state)
  tokens = np.random.default_rng(0).integers(0, 256, (2, 12))
  adapted_logits = np.asarray(
      mb.create_model(mb.load_config(str(tmp_path / "base" / "config.yml")), params=adapted).logits(
          jnp.asarray(tokens, jnp.int32)
      )
  )
  # The merged checkpoint is W + alpha/r * A @ B, computed here independently for one kernel.
  merged_params, _ = checkpointing.load_params(tmp_path / "merged")
  base_params, _ = checkpointing.load_params(tmp_path / "base")
  adapters = canonical.flatten(restored["params"]["lora"])
  path = "decoder/layers/self_attention/query/kernel"
  a, b = np.asarray(adapters[path + "_lora_a"]), np.asarray(adapters[path + "_lora_b"])  # [D, L, r], [r, L, H, K]
  expected = canonical.flatten(base_params)[path] + LORA["lora_alpha"] / LORA["lora_rank"] * np.einsum(
      "dlr,rlhk->dlhk", a, b
  )
  np.testing.assert_allclose(canonical.flatten(merged_params)[path], expected, rtol=0, atol=1e-6)
  merged_logits = mb.from_pretrained(tmp_path / "merged", backend="nnx").logits(jnp.asarray(tokens, jnp.int32))
  np.testing.assert_allclose(np.asarray(merged_logits), adapted_logits, rtol=0, atol=1e-5)
  # A LoRA run reads as its base with the adapters merged in (what `maxbridge generate runs/lora` runs).
  run_logits = mb.from_pretrained(run_dir, backend="linen").logits(jnp.asarray(tokens, jnp.int32))
  np.testing.assert_allclose(np.asarray(run_logits), adapted_logits, rtol=0, atol=1e-5)
  exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
  with torch.no_grad():
    hf_logits = exported(torch.tensor(tokens)).logits.numpy()
  np.testing.assert_allclose(hf_logits, adapted_logits, rtol=0, atol=1e-4)
  base_logits = mb.from_pretrained(tmp_path / "hf").logits(jnp.asarray(tokens, jnp.int32))
  assert np.abs(np.asarray(base_logits) - adapted_logits).max() > 1e-3, "the adapters changed nothing"
