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
from maxbridge.core import canonical, checkpointing
from maxbridge import cli
from maxbridge.training import data
from maxbridge.models import dispatch, lora
from maxbridge.interop import lora_merge, pretrained
from maxbridge.core.config import ConfigError
from maxbridge.training import recipe
from conftest import LINEN_ARGS, flag_id, tiny_config

train_module = importlib.import_module("maxbridge.training.loop")  # `maxbridge.train` the function shadows it

LINEN = (False, False, False)
NNX = (True, True, True)
LORA = dict(lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, per_device_batch_size=2, max_target_length=16)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(lora_rank=-1), r"'lora_rank' = -1 is invalid; it must be >= 0"),
        (dict(lora_alpha=0.0), r"'lora_alpha' = 0.0 is invalid; it must be > 0"),
        (dict(lora_module_path="decoder/(("), r"'lora_module_path' = 'decoder/\(\(' is not a regular expression"),
        (dict(lora_dropout=1.0), r"'lora_dropout' = 1.0 is invalid; it must be in \[0, 1\)"),
        (
            dict(lora_rank=4, lora_weight_qtype="int4"),
            r"'lora_weight_qtype' = 'int4' is invalid; valid values: '', 'int8', 'nf4'",
        ),
        (dict(lora_weight_qtype="nf4"), r"lora_weight_qtype='nf4' quantizes the frozen base .* set lora_rank > 0"),
        (dict(lora_rank=4, lora_weight_qtype="int8", quantization="int8"), r"lora_weight_qtype='int8' with quantization"),
        (dict(lora_rank=4, use_qk_clip=True), r"lora_rank > 0 with use_qk_clip=true"),
    ],
)
def test_bad_lora_config_names_the_key(overrides, match):
  with pytest.raises(ConfigError, match=match):
    tiny_config(**overrides)


def test_a_module_path_matching_nothing_lists_the_kernels():
  with pytest.raises(ValueError, match=r"matches no kernel .* decoder/layers/mlp/wi_0/kernel"):
    recipe.create_trainer(tiny_config(lora_rank=4, lora_module_path="decoder/layers_0/.*"))


def test_a_rank_above_what_a_kernel_can_have_is_refused_naming_the_kernel():
  key = dict(lora_module_path="decoder/layers/self_attention/key/kernel")  # llama-tiny: [64, 2 x 16]
  with pytest.raises(
      ValueError, match=r"lora_rank=33 exceeds the rank of .*key/kernel: its 64 inputs x 32 outputs have rank at most 32"
  ):
    recipe.create_trainer(tiny_config(lora_rank=33, **key))
  assert recipe.create_trainer(tiny_config(lora_rank=32, **key)).trainable.abstract_trained


@pytest.mark.parametrize(
    "axes, inputs",
    [
        (("heads", "kv", "embed"), 2),  # attention's out, and linear attention's out_proj: heads x head_dim in
        (("mlp", "embed"), 1),
        (("embed", "q_heads", "kv"), 1),
        (("embed", "kv_heads", None), 1),  # Qwen3-Next's in_proj_qkvz
        (("kv_lora", "kv_heads", "kv_head_dim"), 1),  # MLA's up-projection reads the latent
        (("embed", "vocab"), 1),
    ],
)
def test_a_kernels_inputs_are_read_from_its_logical_axes(axes, inputs):
  assert lora.in_ndim(axes) == inputs


def test_adapters_have_canonical_names_and_shapes():
  trainer = recipe.create_trainer(tiny_config(NNX, **LORA, lora_module_path=r"decoder/layers/self_attention/.*"))
  flat = {p: x.shape for p, x in canonical.flatten(trainer.trainable.abstract_trained).items()}
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
  """(per-step losses, base before and after, as held too, adapters after, checkpoint tree, final state) of STEPS
  steps from seed 0."""
  state = trainer.init_state(0)
  before = jax.device_get(trainer.params(state))
  stored_before = jax.device_get(trainer.stored_base(state))
  adapted = jax.device_get(trainer.model_params(state))
  losses = []
  for batch in _batches(trainer.config):
    state, metrics = trainer.train_step(state, trainer.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return dict(
      losses=losses,
      before=before,
      stored_before=stored_before,
      adapted=adapted,
      after=jax.device_get(trainer.params(state)),
      stored_after=jax.device_get(trainer.stored_base(state)),
      adapters=jax.device_get(trainer.trained_params(state)),
      adapted_after=jax.device_get(trainer.model_params(state)),
      checkpoint=jax.device_get(trainer.to_checkpoint(state)),
      state=state,
      trainer=trainer,
  )


@pytest.fixture(scope="module")
def trainers():
  return {flags: recipe.create_trainer(tiny_config(flags, **RUN)) for flags in BACKENDS}


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
  trainer = recipe.create_trainer(tiny_config(NNX, **RUN, scan_layers=False))
  np.testing.assert_allclose(_train(trainer)["losses"], runs[LINEN]["losses"], rtol=0, atol=1e-5)


def test_remat_accumulation_and_vocab_tiling_with_an_adapted_head_match_across_backends():
  overrides = dict(
      remat_policy="full",
      gradient_accumulation_steps=2,
      per_device_batch_size=1,
      num_vocab_tiling=2,
      lora_module_path=r"decoder/(layers/(self_attention|mlp)/\w+|logits_dense)/kernel",
  )
  linen, nnx = (_train(recipe.create_trainer(tiny_config(flags, **{**RUN, **overrides}))) for flags in (LINEN, NNX))
  assert "logits_dense" in linen["adapters"]["decoder"]
  np.testing.assert_allclose(nnx["losses"], linen["losses"], rtol=0, atol=1e-5)
  assert linen["losses"][-1] < linen["losses"][0]


# --- QLoRA and adapter dropout ----------------------------------------------------------------------------

# int8 alone; nf4 with dropout on the adapters' inputs. One compile per backend each.
QLORA = {"int8": dict(lora_weight_qtype="int8"), "nf4": dict(lora_weight_qtype="nf4", lora_dropout=0.25)}
QLORA_CASES = [(qtype, flags) for qtype in QLORA for flags in (LINEN, NNX)]
QLORA_IDS = [f"{qtype}-{'nnx' if flags == NNX else 'linen'}" for qtype, flags in QLORA_CASES]


@pytest.fixture(scope="module")
def qlora_runs():
  return {
      (qtype, flags): _train(recipe.create_trainer(tiny_config(flags, **RUN, **QLORA[qtype])))
      for qtype, flags in QLORA_CASES
  }


@pytest.mark.parametrize("qtype,flags", QLORA_CASES, ids=QLORA_IDS)
def test_qlora_stores_the_base_quantized_never_updates_it_and_trains_alike_on_both_backends(qtype, flags, qlora_runs):
  run = qlora_runs[qtype, flags]
  stored = canonical.flatten(run["stored_before"])
  kernels = [p for p in stored if p.startswith("decoder/layers/") and p.endswith("/kernel_qvalue")]
  # llama-tiny's layer kernels: query, key, value, out, wi_0, wi_1, wo.
  assert len(kernels) == 7, sorted(stored)
  assert not [p for p in stored if p.startswith("decoder/layers/") and p.endswith("/kernel")]
  for path in kernels:
    assert stored[path].dtype == {"int8": np.int8, "nf4": jnp.uint4}[qtype], path
    assert stored[path.replace("_qvalue", "_scale")].dtype == np.float32, path
  assert stored["token_embedder/embedding"].dtype == np.float32  # embeddings, norms and the head stay float
  after = canonical.flatten(run["stored_after"])
  assert sorted(after) == sorted(stored)
  for path, leaf in stored.items():
    np.testing.assert_array_equal(np.asarray(after[path]), np.asarray(leaf), err_msg=f"stored base {path} changed")
  for path, leaf in canonical.flatten(run["adapters"]).items():
    if path.endswith("_lora_b"):
      assert np.abs(leaf).max() > 0, f"{path} never trained"
  assert run["losses"][-1] < run["losses"][0] - 0.5, run["losses"]
  np.testing.assert_allclose(run["losses"], qlora_runs[qtype, LINEN]["losses"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("qtype", QLORA)
def test_qlora_runs_on_the_dequantized_base(qtype, qlora_runs, full_model_params):
  run = qlora_runs[qtype, NNX]
  stored, base = canonical.flatten(run["stored_before"]), canonical.flatten(run["before"])
  # Step 0 is the dequantized base exactly; that is the float base up to the quantization's rounding.
  for path, leaf in canonical.flatten(run["adapted"]).items():
    np.testing.assert_array_equal(leaf, base[path], err_msg=path)
  path = "decoder/layers/mlp/wi_0/kernel"
  error = np.abs(base[path] - full_model_params[path]).max()
  scale = np.asarray(stored[path + "_scale"]).max()
  # int8: half a step of absmax / 127.5; nf4: half the widest gap of its codebook (-1 to -0.6962), of the block's absmax.
  assert 0 < error <= {"int8": 0.5, "nf4": 0.1519}[qtype] * scale * 1.001, (error, scale)
  # nf4 blocks: 64 inputs (llama-tiny's embed dim), one scale each per output channel and layer.
  if qtype == "nf4":
    assert stored[path + "_scale"].shape == (1, 2, 128)


def test_lora_dropout_draws_one_mask_per_step_adapter_and_layer_the_same_scanned_or_not():
  config = tiny_config(NNX, **RUN, lora_dropout=0.25)
  model = mb.create_model(config, seed=0)
  abstract = lora.abstract_adapters(config, model.params(), model.logical_axes())
  ones = jax.tree.map(lambda x: jnp.ones(x.shape, x.dtype), abstract)
  key = lora.dropout_key(config, 3)
  dropped = canonical.flatten(lora.drop_adapter_inputs(config, ones, key))
  for path, leaf in dropped.items():
    if path.endswith("_lora_b"):
      np.testing.assert_array_equal(leaf, 1.0, err_msg=f"{path}: B is not dropped")
      continue
    # A's rows (input features) are dropped or scaled by 1 / (1 - p) as a whole, across the rank axis.
    assert set(np.unique(leaf)) <= {0.0, np.float32(1 / 0.75)}, path
    np.testing.assert_array_equal(leaf, np.broadcast_to(leaf[..., :1], leaf.shape), err_msg=path)
    assert 0.1 < (leaf == 0).mean() < 0.4, path
  layers = canonical.flatten(lora.drop_adapter_inputs(config, canonical.unstack_layers(ones, 1), key))
  for path, leaf in canonical.flatten(canonical.unstack_layers(canonical.unflatten(dropped), 1)).items():
    np.testing.assert_array_equal(layers[path], leaf, err_msg=f"{path}: unscanned layers draw other masks")
  path = "decoder/layers/mlp/wi_0/kernel_lora_a"
  layer_0, layer_1 = dropped[path][:, 0], dropped[path][:, 1]
  other_step = canonical.flatten(lora.drop_adapter_inputs(config, ones, lora.dropout_key(config, 4)))[path]
  assert not np.array_equal(layer_0, layer_1) and not np.array_equal(other_step, dropped[path])


@pytest.mark.parametrize("qtype", QLORA)
def test_lora_dropout_applies_in_train_steps_only(qtype, qlora_runs):
  """Train and eval losses of one state and batch agree without dropout, and differ with it."""
  run = qlora_runs[qtype, NNX]
  trainer = run["trainer"]
  batch = trainer.shard_batch(_batches(trainer.config)[0])
  eval_loss = float(trainer.eval_step(run["state"], batch)["loss"])
  _, metrics = trainer.train_step(run["state"], batch)  # donates the state: this test is its last reader
  if trainer.config.lora_dropout:
    assert abs(float(metrics["loss"]) - eval_loss) > 1e-3, (float(metrics["loss"]), eval_loss)
  else:
    np.testing.assert_allclose(float(metrics["loss"]), eval_loss, rtol=0, atol=1e-5)


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
  with pytest.raises(checkpointing.CheckpointError, match=r"trained on base .*base-a .* not .*base-b"):
    mb.train(_run_config(tmp_path, "run", NNX, load_parameters_path=second), trainer=trainers[NNX], progress=False)


# --- merge and export ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, qlora_runs):
  """An int8 QLoRA run (NNX) on a saved base of seed 0: (base folder, run folder)."""
  tmp_path = tmp_path_factory.mktemp("qlora")
  run = qlora_runs["int8", NNX]
  base = _save_base(tmp_path / "base", 0)
  config = _run_config(tmp_path, "qlora", NNX, **QLORA["int8"], load_parameters_path=base)
  losses = [r["loss"] for r in mb.train(config, trainer=run["trainer"], progress=False)]
  np.testing.assert_allclose(losses, run["losses"], rtol=0, atol=1e-6)
  return tmp_path / "base", tmp_path / "qlora"


def test_a_qlora_run_reads_as_its_dequantized_base_with_the_adapters_merged_in(qlora_run, qlora_runs):
  # lora-merge's path: the float base, quantized and dequantized as training held it (its fingerprint checked).
  merged = canonical.flatten(mb.from_pretrained(qlora_run[1], backend="nnx").params())
  for path, leaf in canonical.flatten(qlora_runs["int8", NNX]["adapted_after"]).items():
    np.testing.assert_allclose(merged[path], leaf, rtol=0, atol=1e-6, err_msg=path)


def test_the_engine_serves_a_base_and_its_adapters_unmerged_as_the_merged_model(qlora_run, qlora_runs):
  base, run_dir = qlora_run
  served = mb.Engine.from_pretrained(base, backend="linen", adapters=run_dir, max_target_length=64)
  merged = mb.Engine.from_pretrained(run_dir, backend="linen", max_target_length=64)
  # The engine holds the base (dequantized, as training saw it), not the merged weights.
  stored = canonical.flatten(canonical.unstack_layers(qlora_runs["int8", NNX]["before"], 1))
  for path, leaf in canonical.flatten(served.params).items():
    np.testing.assert_array_equal(np.asarray(leaf), stored[path], err_msg=path)
  assert "decoder/layers_1/mlp/wo/kernel_lora_b" in canonical.flatten(served.adapters)
  prompt = np.array([5, 9, 3, 77, 12])
  out = {}
  for name, eng in (("served", served), ("merged", merged)):
    state = eng.insert(eng.prefill(prompt), eng.init_decode_state(), 0)
    state, first = eng.generate(state)
    state, rest = eng.generate_steps(state, 4)
    out[name] = (np.concatenate([np.asarray(first)[:1], np.asarray(rest)[0]]), np.asarray(state.logits)[0])
  np.testing.assert_array_equal(out["served"][0], out["merged"][0])
  np.testing.assert_allclose(out["served"][1], out["merged"][1], rtol=0, atol=1e-5)
  # Without its adapters the engine serves the base, whose logits differ.
  served.set_adapters(None)
  base_logits = np.asarray(served.prefill(prompt).logits)
  assert np.abs(base_logits - np.asarray(merged.prefill(prompt).logits)).max() > 1e-3


@pytest.mark.parametrize("merge_first", [False, True], ids=["quantize", "lora-merge-then-quantize"])
def test_a_qlora_run_quantizes_as_its_merged_model_at_the_runs_step(qlora_run, tmp_path, capsys, merge_first):
  """The merged model is a plain one (no LoRA keys, which quantization would refuse beside lora_weight_qtype),
  labelled with the step its adapters were saved at."""
  base, run_dir = qlora_run
  step = checkpointing.resolve(run_dir)[1]
  source = run_dir
  if merge_first:
    assert cli.main(["lora-merge", str(base), str(run_dir), str(tmp_path / "merged")]) == 0
    source = tmp_path / "merged"
    assert checkpointing.resolve(source)[1] == step
  assert cli.main(["quantize", str(source), str(tmp_path / "int8"), "quantization=int8"]) == 0
  assert f"at step {step}," in capsys.readouterr().out
  config, merged = pretrained.load_pretrained(run_dir)
  assert (config.lora_rank, config.lora_weight_qtype, config.load_parameters_path) == (0, "", "")
  expected = dispatch.quantize_params(config.replace(quantization="int8", checkpoint_is_quantized=True), merged)
  got, info = checkpointing.load_params(tmp_path / "int8")
  assert checkpointing.resolve(tmp_path / "int8")[1] == step
  for path, value in canonical.flatten(expected).items():
    np.testing.assert_array_equal(canonical.flatten(got)[path], np.asarray(value), err_msg=path)


def test_lora_merge_refuses_an_existing_destination_and_another_base(linen_run, tmp_path):
  config, _ = linen_run
  run_dir = str(train_module.run_directory(config))
  (tmp_path / "taken").mkdir()
  (tmp_path / "taken" / "file").write_text("mine")
  assert cli.main(["lora-merge", _save_base(tmp_path / "base", 0), run_dir, str(tmp_path / "taken")]) == 2
  assert (tmp_path / "taken" / "file").read_text() == "mine"
  with pytest.raises(checkpointing.CheckpointError, match=r"trained on base seed 0 .* not on .*other"):
    lora_merge.merge_checkpoint(_save_base(tmp_path / "other", 7), run_dir, tmp_path / "merged")
  assert not (tmp_path / "merged").exists()


def test_merged_then_exported_model_matches_the_adapted_model_in_transformers(tmp_path):
  """import-hf -> LoRA training -> lora-merge -> export-hf: transformers computes the adapted model's logits."""
  transformers = pytest.importorskip("transformers")
  torch = pytest.importorskip("torch")
  torch.manual_seed(0)
  dims = dict(hidden_size=64, num_hidden_layers=2, vocab_size=256, num_attention_heads=4, num_key_value_heads=2)
  hf_model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**dims, intermediate_size=128))
  hf_model.save_pretrained(tmp_path / "hf")
  assert cli.main(["import-hf", str(tmp_path / "hf"), str(tmp_path / "base"), *LINEN_ARGS]) == 0
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
  trainer = recipe.create_trainer(config)
  checkpoints = checkpointing.Checkpointer(run_dir / "checkpoints", create=False)
  restored = checkpoints.restore(STEPS, trainer.checkpoint_target())
  checkpoints.close()
  state = trainer.with_checkpoint(train_module.initial_state(config, trainer), restored)
  adapted = trainer.model_params(state)
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
  base_logits = mb.from_pretrained(tmp_path / "hf", backend="linen").logits(jnp.asarray(tokens, jnp.int32))
  assert np.abs(np.asarray(base_logits) - adapted_logits).max() > 1e-3, "the adapters changed nothing"
