"""Quantization on both backends: AQT int8 training (QAT) and serving, Qwix QAT; the same numbers in every flag combination."""

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxbridge as mb
from maxbridge.core import canonical, checkpointing
from maxbridge import cli
from maxbridge.training import data
from maxbridge.models import dispatch
from maxbridge.ops import quantization as quantization_module
from maxbridge.core.config import ConfigError
from maxbridge.training.loop import global_batch_size
from maxbridge.training import recipe
from maxbridge.interop import pretrained, quantize
from conftest import FLAG_COMBINATIONS, LINEN_ARGS, LINEN_FLAGS, flag_id, tiny_config

LINEN = (False, False, False)
NNX = (True, True, True)
TRAIN = dict(steps=30, per_device_batch_size=4, eval_interval=0, checkpoint_period=15)


@pytest.mark.parametrize(
    "overrides,match",
    [
        (
            dict(quantization="int3"),
            r"'quantization' = 'int3' is invalid; valid values: '', 'int8', 'int4', 'fp8', 'nf4'",
        ),
        (
            dict(quantization="int4"),
            r"'int4' is not supported with use_qwix_quantization=false \(aqt\); valid values: '', 'int8'",
        ),
        (dict(checkpoint_is_quantized=True), r"checkpoint_is_quantized=true needs .* set quantization"),
        (dict(quantization_local_shard_count=-2), r"'quantization_local_shard_count' = -2 is invalid"),
    ],
)
def test_bad_quantization_config_names_the_key_and_the_valid_values(overrides, match):
  with pytest.raises(ConfigError, match=match):
    tiny_config(**overrides)


@pytest.fixture(scope="module")
def float_model():
  return mb.create_model(tiny_config(), seed=0)


@pytest.fixture(scope="module")
def aqt_reference(tokens):
  """Pure Linen AQT int8 logits, scanned and unscanned (the float weights of seed 0)."""
  return {
      scan: np.asarray(mb.create_model(tiny_config(quantization="int8", scan_layers=scan), seed=0).logits(tokens))
      for scan in (True, False)
  }


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS, ids=map(flag_id, FLAG_COMBINATIONS))
def test_aqt_int8_logits_match_pure_linen_in_every_flag_combination(flags, tokens, float_model, aqt_reference):
  model = mb.create_model(tiny_config(flags, quantization="int8"), seed=0)
  # Train mode keeps the float kernels: the canonical tree is the float model's.
  assert model.abstract_params() == float_model.abstract_params()
  logits = np.asarray(model.logits(tokens))
  np.testing.assert_allclose(logits, aqt_reference[True], atol=1e-6, rtol=0, err_msg=flag_id(flags))
  # ...and it is quantized: int8 rounding moves the logits well past float noise.
  assert np.abs(logits - np.asarray(float_model.logits(tokens))).max() > 1e-3


@pytest.mark.parametrize("remat_policy", ["none", "full"])
def test_aqt_int8_unscanned_and_remat_match_between_backends(tokens, aqt_reference, remat_policy):
  for flags in (LINEN, NNX):
    config = tiny_config(flags, quantization="int8", scan_layers=False, remat_policy=remat_policy)
    logits = np.asarray(mb.create_model(config, seed=0).logits(tokens))
    np.testing.assert_allclose(logits, aqt_reference[False], atol=1e-6, rtol=0, err_msg=f"{flag_id(flags)}")


# --- AQT stochastic rounding of gradients, keyed by the train step ---------------


@pytest.fixture(scope="module")
def aqt_grads(tokens):
  """(flags, step or None, overrides) -> canonical gradients of an AQT int8 model (seed 0), one compile per model."""
  compiled = {}

  def grads(flags, step, **overrides):
    if (flags, *overrides.items()) not in compiled:
      config = tiny_config(flags, quantization="int8", **overrides)
      model = mb.create_model(config, seed=0)

      def keyed(params, step):
        with quantization_module.stochastic_rounding(config, step):
          return jax.grad(lambda p: model.apply(p, tokens).std())(params)

      unkeyed = jax.grad(lambda p: model.apply(p, tokens).std())
      compiled[(flags, *overrides.items())] = (model.params(), jax.jit(keyed), jax.jit(unkeyed))
    params, keyed, unkeyed = compiled[(flags, *overrides.items())]
    return canonical.flatten(unkeyed(params) if step is None else keyed(params, step))

  return grads


def max_difference(a, b):
  assert set(a) == set(b)
  return max(float(np.abs(np.asarray(a[p]) - np.asarray(b[p])).max()) for p in a)


@pytest.mark.parametrize(
    "flags,overrides",
    [
        (NNX, {}),
        ((False, True, False), {}),
        ((True, False, True), {}),
        (NNX, dict(scan_layers=False, remat_policy="full")),
    ],
    ids=["nnx", "linen-nnx_decoder", "nnx-linen_decoder", "nnx-unscanned-remat"],
)
def test_aqt_stochastic_rounding_gradients_are_bit_identical_to_pure_linen(flags, overrides, aqt_grads):
  reference = aqt_grads(LINEN, 3, **overrides)
  got = aqt_grads(flags, 3, **overrides)
  for path, grad in reference.items():
    np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(grad), err_msg=f"{flag_id(flags)} {path}")


def test_aqt_gradients_round_stochastically_by_the_step_and_to_nearest_without_a_key(aqt_grads):
  step3, step4, nearest = aqt_grads(LINEN, 3), aqt_grads(LINEN, 4), aqt_grads(LINEN, None)
  assert max_difference(step3, aqt_grads(LINEN, 3)) == 0.0, "the same step must round alike"
  assert max_difference(step3, step4) > 1e-6, "the step's key changes nothing: stochastic rounding is off"
  assert max_difference(step3, nearest) > 1e-6 and max_difference(step4, nearest) > 1e-6


def test_the_train_step_keys_stochastic_rounding_by_its_step():
  """One state, trained as step 0 and as step 1: the gradients (their norm) differ by their rounding only.

  The step is the backends' shared `Trainer._train_step`; the Linen-run-resumed-in-NNX test below covers NNX.
  """
  # The config, batch shape and state types of the `runs` fixture's int8 run, so that the two share their compiled
  # init and step through the suite's compilation cache: a step of its own compiled for 10 s.
  config = tiny_config(quantization="int8", **TRAIN)
  trainer = recipe.create_trainer(config)
  initial = trainer.init_state(0)
  batch = trainer.shard_batch(data.make_dataset(config, "train", global_batch_size(config)).batch(0))
  norms = []
  for step in (0, 1, 0):
    state = jax.tree.map(jnp.copy, initial).replace(step=initial.step + step)  # a copy: the step donates its state
    norms.append(float(trainer.train_step(state, batch)[1]["grad_norm"]))
  assert norms[0] != norms[1] and norms[0] == norms[2], norms


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """30 steps of float and of AQT int8 (Linen), and the int8 run's step-15 checkpoint resumed in NNX."""
  root = tmp_path_factory.mktemp("runs")

  def run(name, flags, **overrides):
    config = tiny_config(flags, base_output_directory=str(root), run_name=name, **TRAIN, **overrides)
    return [r["loss"] for r in mb.train(config, progress=False)]

  losses = dict(float=run("float", LINEN), int8=run("int8", LINEN, quantization="int8"))
  shutil.copytree(root / "int8", root / "flip")
  shutil.rmtree(root / "flip" / "checkpoints" / "30")
  losses["resumed"] = run("flip", NNX, quantization="int8")
  return dict(root=root, **losses)


def test_aqt_int8_training_learns_and_ends_within_5_percent_of_float(runs):
  float_losses, int8_losses = runs["float"], runs["int8"]
  assert int8_losses[-1] < int8_losses[0] - 1.0, f"int8 QAT should learn: {int8_losses}"
  assert abs(int8_losses[-1] / float_losses[-1] - 1) < 0.05, (int8_losses[-1], float_losses[-1])
  assert int8_losses != float_losses, "quantization changed nothing"


@pytest.mark.fusion_emitters  # int8 rounding over 15 steps
def test_linen_aqt_run_resumed_in_nnx_continues_the_same_losses(runs):
  assert len(runs["resumed"]) == 15
  np.testing.assert_allclose(runs["resumed"], runs["int8"][15:], rtol=1e-5)


def test_aqt_state_and_checkpoints_hold_no_intermediates(runs):
  float_trainer = recipe.create_trainer(tiny_config())
  for flags in (LINEN, NNX):
    trainer = recipe.create_trainer(tiny_config(flags, quantization="int8"))
    assert trainer.disk_layout == float_trainer.disk_layout, flag_id(flags)
  nnx_state = recipe.create_trainer(tiny_config(NNX, quantization="int8")).abstract_state()
  assert not nnx.state(nnx_state, nnx.Intermediate), "sown values in the NNX train state"
  ckpt = checkpointing.Checkpointer(runs["root"] / "int8" / "checkpoints")
  saved = ckpt.restore(30, jax.tree.map(lambda x: x, float_trainer.checkpoint_target()))
  ckpt.close()
  assert set(saved) == {"params", "opt_state", "step"} and set(saved["params"]) == {"params"}


# --- Qwix QAT -------------------------------------------------------------------


def qwix_config(flags, quantization, **overrides):
  return tiny_config(flags, quantization=quantization, use_qwix_quantization=True, **overrides)


# Each also runs in one mixed flag combination, so that every combination (each
# bridge direction around the decoder, and both at once) is checked once.
@pytest.mark.parametrize(
    "quantization,overrides,mixed",
    [
        ("int8", {}, (True, False, True)),  # NNX state > ToNNX(Linen model) > ToLinen(NNX decoder)
        (
            "int4",
            dict(scan_layers=False),
            (False, True, False),
        ),  # Linen state > ToLinen(NNX model) > ToNNX(Linen decoder)
        ("fp8", dict(remat_policy="full"), (False, False, True)),  # Linen model > ToLinen(NNX decoder)
        ("fp8", dict(remat_policy="full", scan_layers=False), (True, True, False)),  # NNX model > ToNNX(Linen decoder)
    ],
    ids=["int8", "int4-unscanned", "fp8-remat", "fp8-remat-unscanned"],
)
def test_qwix_logits_and_gradients_match_between_linen_nnx_and_mixed_flags(
    quantization, overrides, mixed, tokens, float_model
):
  results = {}
  float_params = mb.create_model(tiny_config(**overrides), seed=0).abstract_params()
  for flags in (LINEN, NNX, mixed):
    model = mb.create_model(qwix_config(flags, quantization, **overrides), seed=0)
    assert model.abstract_params() == float_params, "QAT adds no parameters"
    loss = lambda params: model.apply(params, tokens).std()  # noqa: E731
    value_and_grad = jax.value_and_grad(lambda p: (loss(p), model.apply(p, tokens)), has_aux=True)
    (_, logits), grads = jax.jit(value_and_grad)(model.params())
    results[flags] = logits, canonical.flatten(grads)
  linen_logits, linen_grads = results.pop(LINEN)
  for flags, (logits, grads) in results.items():
    np.testing.assert_allclose(logits, linen_logits, atol=1e-6, rtol=0, err_msg=flag_id(flags))
    assert set(grads) == set(linen_grads)
    for path, grad in linen_grads.items():
      np.testing.assert_allclose(grads[path], grad, atol=1e-6, rtol=0, err_msg=f"{flag_id(flags)} {path}")
  assert np.abs(np.asarray(linen_logits) - np.asarray(float_model.logits(tokens))).max() > 1e-3


@pytest.mark.parametrize("flags", [(False, True, True), (True, False, False)], ids=flag_id)
def test_qwix_int8_logits_in_the_other_mixed_flag_combinations_equal_pure_linen(flags, tokens, qwix_qat_logits):
  model = mb.create_model(qwix_config(flags, "int8"), seed=0)
  np.testing.assert_array_equal(np.asarray(model.logits(tokens)), qwix_qat_logits["int8"])


@pytest.mark.parametrize("flags", [NNX, (True, False, True)], ids=flag_id)
def test_qwix_nnx_model_holds_only_the_float_parameters(flags, tokens):
  model = mb.create_model(qwix_config(flags, "int8"), seed=0)
  model.logits(tokens)
  # No sown values, no RNG state, no quantization statistics: the float model's variables exactly.
  assert set(type(v).__name__ for _, v in nnx.to_flat_state(nnx.state(model.module))) == {"Param"}


def test_a_float_model_built_after_a_quantized_one_gives_the_same_float_logits(tokens):
  for flags in (LINEN, NNX, (True, False, True)):
    before = np.asarray(mb.create_model(tiny_config(flags), seed=0).logits(tokens))
    mb.create_model(qwix_config(flags, "int8"), seed=0).logits(tokens)
    after = np.asarray(mb.create_model(tiny_config(flags), seed=0).logits(tokens))
    np.testing.assert_array_equal(after, before, err_msg=flag_id(flags))


@pytest.fixture(scope="module")
def qwix_runs(tmp_path_factory, runs):
  """30 steps: Qwix int8 in Linen (its step-15 checkpoint resumed in NNX), int4 and fp8 (remat) in NNX."""
  root = tmp_path_factory.mktemp("qwix")

  def run(name, flags, quantization, **overrides):
    config = qwix_config(flags, quantization, base_output_directory=str(root), run_name=name, **TRAIN, **overrides)
    return [r["loss"] for r in mb.train(config, progress=False)]

  losses = dict(int8=run("int8", LINEN, "int8"))
  shutil.copytree(root / "int8", root / "flip")
  shutil.rmtree(root / "flip" / "checkpoints" / "30")
  losses["resumed"] = run("flip", NNX, "int8")
  losses["int4"] = run("int4", NNX, "int4")
  losses["fp8"] = run("fp8", NNX, "fp8", remat_policy="full")
  return dict(float=runs["float"], **losses)


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_qwix_training_learns_and_ends_within_5_percent_of_float(qwix_runs, quantization):
  losses, float_losses = qwix_runs[quantization], qwix_runs["float"]
  assert losses[-1] < losses[0] - 1.0, f"Qwix {quantization} QAT should learn: {losses}"
  assert abs(losses[-1] / float_losses[-1] - 1) < 0.05, (losses[-1], float_losses[-1])


@pytest.mark.fusion_emitters  # int8 rounding over 15 steps
def test_linen_qwix_run_resumed_in_nnx_continues_the_same_losses(qwix_runs):
  np.testing.assert_allclose(qwix_runs["resumed"], qwix_runs["int8"][15:], rtol=1e-5)


@pytest.mark.fusion_emitters  # int8 rounding over 15 steps
def test_qwix_run_with_the_decoder_behind_two_bridges_trains_as_pure_linen(qwix_runs, tmp_path):
  flags = (True, False, True)  # NNX state > ToNNX(Linen model) > ToLinen(NNX decoder): the first steps of the Linen run
  config = qwix_config(flags, "int8", base_output_directory=str(tmp_path), run_name="run", **TRAIN)
  trainer = recipe.create_trainer(config)
  losses = [r["loss"] for r in mb.train(config, trainer=trainer, until_step=4, progress=False)]
  np.testing.assert_allclose(losses, qwix_runs["int8"][:4], rtol=1e-5)
  float_trainer = recipe.create_trainer(tiny_config(flags))
  assert trainer.disk_layout == float_trainer.disk_layout
  ckpt = checkpointing.Checkpointer(tmp_path / "run" / "checkpoints")
  saved = ckpt.restore(4, jax.tree.map(lambda x: x, float_trainer.checkpoint_target()))
  ckpt.close()
  assert set(saved) == {"params", "opt_state", "step"} and set(saved["params"]) == {"params"}


# --- AQT convert and serve: frozen int8 values and scales, `maxbridge quantize` -------


def serve_config(flags=LINEN, **overrides):
  return tiny_config(flags, quantization="int8", checkpoint_is_quantized=True, **overrides)


@pytest.mark.parametrize(
    "flags,scan",
    [
        (LINEN, True),
        (NNX, True),
        (LINEN, False),
        (NNX, False),
        ((False, True, False), True),
        ((True, False, True), False),
    ],
    ids=["linen", "nnx", "linen-unscanned", "nnx-unscanned", "linen-nnx_model", "nnx-linen_model-unscanned"],
)
def test_serve_logits_equal_convert_mode_logits_exactly(flags, scan, tokens, float_model, aqt_reference):
  """Convert (train mode on float weights: the kernels quantized on the fly) -> serve: the same bits."""
  serve_params = dispatch.quantize_params(serve_config(flags, scan_layers=scan), float_model.params())
  model = mb.create_model(serve_config(flags, scan_layers=scan), params=serve_params)
  np.testing.assert_array_equal(np.asarray(model.logits(tokens)), aqt_reference[scan], err_msg=flag_id(flags))
  flat = canonical.flatten(model.params())
  assert not [p for p in flat if p.endswith("/kernel")], "a float kernel in a serve model"
  qvalues = [p for p in flat if p.endswith("/kernel_qvalue")]
  assert len(qvalues) == (8 if scan else 15) and all(flat[p].dtype == np.int8 for p in qvalues)  # 7 per stack + head
  assert flat["token_embedder/embedding"].dtype == np.float32
  assert flat["decoder/decoder_norm/scale"].dtype == np.float32


def test_convert_of_a_scanned_stack_equals_convert_of_its_layers_one_by_one(float_model):
  scanned = dispatch.quantize_params(serve_config(scan_layers=True), float_model.params())
  unscanned = dispatch.quantize_params(serve_config(scan_layers=False), float_model.params())
  stacked = canonical.flatten(canonical.stack_layers(unscanned, 1))
  scanned = canonical.flatten(scanned)
  assert set(stacked) == set(scanned)
  for path, value in scanned.items():
    np.testing.assert_array_equal(np.asarray(stacked[path]), np.asarray(value), err_msg=path)
  # Per layer, per output channel: the layer axis (1) keeps its own scales.
  assert scanned["decoder/layers/mlp/wo/kernel_scale"].shape == (1, 2, 64)
  assert scanned["decoder/layers/self_attention/out/kernel_scale"].shape == (1, 2, 1, 64)


@pytest.fixture(scope="module")
def served(tmp_path_factory, float_model):
  """A float checkpoint (with config.yml) and the serve checkpoint `maxbridge quantize` makes of it."""
  root = tmp_path_factory.mktemp("serve")
  save_float_checkpoint(root / "float", tiny_config(), float_model.params())
  assert cli.main(["quantize", str(root / "float"), str(root / "int8"), "quantization=int8"]) == 0
  return root


@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_serve_checkpoint_reloads_with_the_same_qvalues_and_logits(served, backend, tokens, float_model, aqt_reference):
  model = mb.from_pretrained(served / "int8", backend=backend)
  assert model.config.checkpoint_is_quantized and model.config.quantization == "int8"
  expected = canonical.flatten(dispatch.quantize_params(serve_config(), float_model.params()))
  got = canonical.flatten(model.params())
  assert set(got) == set(expected)
  for path, value in expected.items():
    assert np.asarray(got[path]).tobytes() == np.asarray(value).tobytes(), path
  np.testing.assert_array_equal(np.asarray(model.logits(tokens)), aqt_reference[True])


def save_float_checkpoint(directory, config, params):
  checkpointer = checkpointing.Checkpointer(directory)
  checkpointer.save(0, {"params": {"params": params}})
  checkpointer.wait()
  checkpointer.close()
  config.to_yaml(directory / "config.yml")


def test_serve_checkpoint_stores_int8_kernels_in_a_quarter_of_their_float_bytes(tmp_path):
  # Wide enough that a per-channel float32 scale (1/in_features of the kernel) stays under 1%.
  config = tiny_config(base_emb_dim=256, head_dim=64, base_mlp_dim=512)
  save_float_checkpoint(tmp_path / "float", config, mb.create_model(config, seed=0).params())
  quantize.quantize_checkpoint(tmp_path / "float", tmp_path / "int8", "quantization=int8")
  stored = checkpointing.CheckpointReader(tmp_path / "int8").leaves
  float_leaves = checkpointing.CheckpointReader(tmp_path / "float").leaves
  assert not [p for p in stored if p.endswith("/kernel")], "a float kernel on disk"
  quantized = float_bytes = 0
  for path, leaf in stored.items():
    if path.endswith("/kernel_qvalue"):
      assert leaf.dtype == np.int8, path
      kernel = float_leaves[path.removesuffix("_qvalue")]
      ratio = (leaf.nbytes + stored[path.replace("_qvalue", "_scale")].nbytes) / kernel.nbytes
      assert ratio <= 0.26, (path, ratio)
      quantized, float_bytes = quantized + leaf.nbytes, float_bytes + kernel.nbytes
    elif not path.endswith("/kernel_scale"):
      assert leaf == float_leaves[path], path  # norms and embeddings as they were
  assert quantized == float_bytes // 4 and len([p for p in stored if p.endswith("_qvalue")]) == 8


def test_serve_checkpoint_prefills_and_generates(served, capsys):
  engine = mb.Engine.from_pretrained(served / "int8", backend="nnx")
  prompt = np.arange(1, 9, dtype=np.int32)
  prefix = engine.prefill(prompt)
  logits = np.asarray(engine.model.logits(prompt[None]))[0, -1]
  np.testing.assert_allclose(np.asarray(prefix.logits), logits, atol=1e-5, rtol=0)
  assert int(prefix.token) == int(np.argmax(logits))
  assert cli.main(["generate", str(served / "int8"), "--prompt", "hi", "--max-new-tokens", "3"]) == 0


def test_quantize_reads_hugging_face_folders_and_load_parameters_path(served, float_model, tmp_path):

  pretrained.export_hf(served / "float", tmp_path / "hf")
  assert cli.main(["quantize", str(tmp_path / "hf"), str(tmp_path / "from_hf"), "quantization=int8", *LINEN_ARGS]) == 0
  _, hf_params = pretrained.load_pretrained(tmp_path / "hf", **LINEN_FLAGS)
  expected = dispatch.quantize_params(serve_config(), hf_params)
  got, _ = checkpointing.load_params(tmp_path / "from_hf")
  for path, value in canonical.flatten(expected).items():
    np.testing.assert_array_equal(canonical.flatten(got)[path], np.asarray(value), err_msg=path)
  items = served / "float" / "0" / "items"
  argv = ["quantize", "llama-tiny", str(tmp_path / "from_path"), "quantization=int8", f"load_parameters_path={items}"]
  assert cli.main([*argv, *LINEN_ARGS]) == 0
  got, _ = checkpointing.load_params(tmp_path / "from_path")
  reference, _ = checkpointing.load_params(served / "int8")
  for path, value in canonical.flatten(reference).items():
    np.testing.assert_array_equal(canonical.flatten(got)[path], value, err_msg=path)


@pytest.mark.parametrize(
    "source,overrides,message",
    [
        ("float", ["quantization=int3"], "'quantization' = 'int3' is invalid"),
        ("float", ["quantization=int4"], "'int4' is not supported with use_qwix_quantization=false"),
        ("float", [], "needs quantization=int8"),
        ("int8", ["quantization=int8"], "is already quantized"),
        ("missing", ["quantization=int8"], "missing: no such checkpoint, run or Hugging Face folder"),
    ],
    ids=["unknown", "aqt-int4", "no-quantization", "already-quantized", "missing-folder"],
)
def test_quantize_refuses_bad_input_and_writes_nothing(served, tmp_path, capsys, source, overrides, message):
  destination = tmp_path / "out"
  assert cli.main(["quantize", str(served / source), str(destination), *overrides]) == 2
  assert message in capsys.readouterr().err
  assert list(tmp_path.iterdir()) == [], "quantize wrote something"


def test_training_from_a_serve_checkpoint_is_refused(served, tmp_path):
  with pytest.raises(ValueError, match="checkpoint_is_quantized=true: the weights are frozen int8 values"):
    mb.train(serve_config(base_output_directory=str(tmp_path), run_name="a", steps=1), progress=False)
  items = str(served / "int8" / "0" / "items")
  config = tiny_config(base_output_directory=str(tmp_path), run_name="b", steps=1, load_parameters_path=items)
  with pytest.raises(checkpointing.CheckpointError, match="holds a quantized serve checkpoint"):
    mb.train(config, progress=False)
  assert list(tmp_path.iterdir()) == [], "a refused run wrote something"


# --- Qwix PTQ: int8, int4 and fp8 serve weights -----------------------------------


@pytest.fixture(scope="module")
def qwix_qat_logits(tokens):
  """Qwix QAT logits (pure Linen, scanned) of the float weights of seed 0: what PTQ must serve."""
  return {q: np.asarray(mb.create_model(qwix_config(LINEN, q), seed=0).logits(tokens)) for q in ("int8", "int4", "fp8")}


@pytest.mark.parametrize("quantization", ["int8", "int4", "fp8"])
def test_qwix_ptq_of_a_scanned_stack_equals_ptq_of_its_layers_and_serves_the_qat_logits(
    quantization, tokens, float_model, qwix_qat_logits
):
  configs = {scan: qwix_config(LINEN, quantization, checkpoint_is_quantized=True, scan_layers=scan) for scan in (1, 0)}
  scanned, unscanned = (dispatch.quantize_params(configs[scan], float_model.params()) for scan in (1, 0))
  stacked, scanned = canonical.flatten(canonical.stack_layers(unscanned, 1)), canonical.flatten(scanned)
  assert set(stacked) == set(scanned)
  for path, value in scanned.items():
    assert np.asarray(stacked[path]).tobytes() == np.asarray(value).tobytes(), path
  # One scale per layer and output channel: Qwix's own PTQ would share one across the layer axis.
  assert scanned["decoder/layers/mlp/wo/kernel_scale"].shape == (1, 2, 64)
  assert scanned["decoder/layers/mlp/wo/kernel_qvalue"].dtype == quantization_module.qvalue_dtype(configs[1])
  model = mb.create_model(configs[1], params=scanned)
  np.testing.assert_array_equal(np.asarray(model.logits(tokens)), qwix_qat_logits[quantization])
  nnx_model = mb.create_model(
      qwix_config(NNX, quantization, checkpoint_is_quantized=True, scan_layers=False), params=unscanned
  )
  np.testing.assert_allclose(np.asarray(nnx_model.logits(tokens)), qwix_qat_logits[quantization], atol=1e-6, rtol=0)


@pytest.mark.parametrize("flags", [(False, True, False), (True, False, True)], ids=flag_id)
def test_qwix_serving_works_with_mixed_flags(flags, tokens, float_model, qwix_qat_logits):
  config = qwix_config(flags, "int8", checkpoint_is_quantized=True)
  model = mb.create_model(config, params=dispatch.quantize_params(config, float_model.params()))
  np.testing.assert_array_equal(np.asarray(model.logits(tokens)), qwix_qat_logits["int8"])


def test_qwix_int4_serve_checkpoint_reloads_on_both_backends(served, tokens, qwix_qat_logits):
  # Quantized with mixed flags (from_pretrained sets the backend's flags anyway).
  argv = ["quantize", str(served / "float"), str(served / "int4"), "quantization=int4", "use_qwix_quantization=true"]
  assert cli.main([*argv, "pure_nnx=false", "enable_nnx=true", "pure_nnx_decoder=false"]) == 0
  stored = checkpointing.CheckpointReader(served / "int4").leaves
  assert stored["params/params/decoder/layers/mlp/wo/kernel_qvalue"].dtype == jnp.int4
  for backend in ("linen", "nnx"):
    model = mb.from_pretrained(served / "int4", backend=backend)
    np.testing.assert_array_equal(np.asarray(model.logits(tokens)), qwix_qat_logits["int4"], err_msg=backend)


# --- Routed experts: every MoE family's routers and experts quantize, under either library ----------------

MOE_PRESETS = ["mixtral-tiny", "deepseek3-tiny", "qwen3-moe-tiny", "gpt-oss-tiny", "llama4-tiny", "gemma4-moe-tiny"]
MOE_PRESETS += ["qwen3-next-tiny"]
# gemma4-moe-tiny's KV-shared block holds the first block's kinds of experts and routers again: one block is enough.
MOE_OVERRIDES = {"gemma4-moe-tiny": dict(base_num_decoder_layers=6, num_kv_shared_layers=0)}


def _weight_matmuls(jaxpr, found: list) -> list:
  """(lhs dtype, rhs dtype, rhs shape) of every dot_general and ragged_dot in `jaxpr`, nested ones too."""
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
      lhs, rhs = (v.aval for v in eqn.invars[:2])
      found.append((str(lhs.dtype), str(rhs.dtype), tuple(rhs.shape)))
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(sub, jax.extend.core.ClosedJaxpr):
          _weight_matmuls(sub.jaxpr, found)
        elif isinstance(sub, jax.extend.core.Jaxpr):
          _weight_matmuls(sub, found)
  return found


@pytest.mark.parametrize("sparse_matmul", [True, False], ids=["dropless", "dense"])
@pytest.mark.parametrize("qwix", [False, True], ids=["aqt", "qwix"])
@pytest.mark.parametrize("preset", MOE_PRESETS)
def test_every_moe_familys_router_and_experts_multiply_in_int8(preset, qwix, sparse_matmul):
  """Routers ([D, E] kernels) and experts ([E, in, out]) run int8 matmuls on both backends, as the dense
  layers do: AQT through the blocks' matmuls, Qwix by intercepting `jax.lax.dot_general` and `ragged_dot`."""
  tokens = jnp.zeros((2, 8), jnp.int32)
  for flags in (LINEN, NNX):
    config = mb.load_config(
        preset,
        **dict(zip(("pure_nnx", "enable_nnx", "pure_nnx_decoder"), flags)),
        quantization="int8",
        use_qwix_quantization=qwix,
        sparse_matmul=sparse_matmul,
        scan_layers=False,
        **MOE_OVERRIDES.get(preset, {}),
    )
    model = dispatch.abstract_model(config)  # a trace reads shapes only: no parameter is drawn or compiled
    moe_weights = {
        tuple(leaf.shape)
        for path, leaf in canonical.flatten(model.abstract_params()).items()
        if leaf.ndim == 3
        and path.rsplit("/", 1)[-1] in ("wi_0", "wi_1", "wi", "wo")  # [E, in, out]
        or path.endswith("gate/kernel")
    }
    assert len(moe_weights) >= 2, moe_weights  # a router and experts
    jaxpr = jax.make_jaxpr(lambda params: model.apply(params, tokens))(model.abstract_params())  # noqa: B023
    matmuls = _weight_matmuls(jaxpr.jaxpr, [])
    float_ones = {shape for lhs, rhs, shape in matmuls if shape in moe_weights and (lhs, rhs) != ("int8", "int8")}
    assert not float_ones, f"{flag_id(flags)}: float matmuls by {sorted(float_ones)}"
    assert moe_weights <= {shape for _, _, shape in matmuls}, flag_id(flags)


def test_aqts_ragged_dot_rounds_its_forward_pass_and_passes_float_gradients_straight_through():
  lhs, rhs = jax.random.normal(jax.random.key(0), (12, 16)), jax.random.normal(jax.random.key(1), (4, 16, 8))
  group_sizes = jnp.array([3, 0, 5, 4], jnp.int32)
  ragged_dot = quantization_module.ragged_dot(tiny_config(quantization="int8"))
  float_out = jax.lax.ragged_dot(lhs, rhs, group_sizes)
  out = ragged_dot(lhs, rhs, group_sizes)

  # AQT's int8: a scale of |max| / 127.5, values rounded and clipped to +-127; a scale per token's row,
  # and per output channel shared by every expert.
  def fake_quantized(x, axes):
    scale = jnp.abs(x).max(axis=axes, keepdims=True) / 127.5
    return jnp.clip(jnp.round(x / scale), -127, 127) * scale

  fake = jax.lax.ragged_dot(fake_quantized(lhs, 1), fake_quantized(rhs, (0, 1)), group_sizes, precision="highest")
  np.testing.assert_allclose(out, fake, rtol=0, atol=1e-5)
  assert 1e-3 < float(jnp.abs(out - float_out).max()) < 0.05 * float(jnp.abs(float_out).max())
  cotangent = jax.random.normal(jax.random.key(2), out.shape)
  grads = jax.vjp(lambda a, b: ragged_dot(a, b, group_sizes), lhs, rhs)[1](cotangent)
  want = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, group_sizes), lhs, rhs)[1](cotangent)
  for got, expected in zip(grads, want):
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
  assert quantization_module.ragged_dot(tiny_config()) is quantization_module.moe.lax_ragged_dot


@pytest.mark.parametrize(
    "preset, qwix, sparse_matmul",
    [
        ("mixtral-tiny", False, True),
        ("qwen3-moe-tiny", True, True),
        ("gpt-oss-tiny", True, False),  # fused, biased experts
        ("llama4-tiny", False, False),  # input-weighted experts beside a shared one
    ],
    ids=["mixtral-aqt", "qwen3-moe-qwix", "gpt-oss-qwix-dense", "llama4-aqt-dense"],
)
def test_moe_serve_checkpoints_hold_int8_experts_and_serve_the_qat_logits(preset, qwix, sparse_matmul, tmp_path):
  """`maxbridge quantize` stores routed experts as int8 values and per-channel scales (shared by the experts
  for the dropless matmul, as training's), and both backends serve what quantization-aware training computes."""
  tokens = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
  qat = dict(quantization="int8", use_qwix_quantization=qwix, sparse_matmul=sparse_matmul)
  float_config = mb.load_config(preset, sparse_matmul=sparse_matmul)
  save_float_checkpoint(tmp_path / "float", float_config, mb.create_model(float_config, seed=0).params())
  overrides = [f"{key}={str(value).lower()}" for key, value in qat.items()]
  assert cli.main(["quantize", str(tmp_path / "float"), str(tmp_path / "int8"), *overrides]) == 0
  want = np.asarray(mb.create_model(mb.load_config(preset, **qat), seed=0).logits(tokens))
  for backend in ("linen", "nnx"):
    served = mb.from_pretrained(tmp_path / "int8", backend=backend)
    flat = canonical.flatten(served.params())
    experts = {path: leaf for path, leaf in flat.items() if path.endswith("_qvalue") and "kernel" not in path}
    assert len(experts) >= 2, sorted(flat)
    for path, qvalue in experts.items():
      assert qvalue.dtype == jnp.int8 and path.removesuffix("_qvalue") not in flat, path
      scale = flat[path.removesuffix("_qvalue") + "_scale"]
      experts_axis = 0  # [E, (layers,) in, out]
      assert scale.shape[experts_axis] == (1 if sparse_matmul else qvalue.shape[experts_axis]), (path, scale.shape)
    np.testing.assert_allclose(np.asarray(served.logits(tokens)), want, rtol=0, atol=1e-6, err_msg=backend)
