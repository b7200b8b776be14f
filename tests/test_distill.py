"""Distillation (teacher_overrides): alpha * T^2 * KL(teacher || student) + (1 - alpha) * cross-entropy, in the step."""

import json
import types

import jax
import numpy as np
import pytest

import maxbridge as mb
from maxbridge.core import canonical, families
from maxbridge.core.checkpointing import CheckpointError
from maxbridge.core.config import ConfigError
from maxbridge.training import aot, data, distill, hooks, recipe
from maxbridge.models import dispatch
from maxbridge.ops import attention
from maxbridge.training.loss import Forward
from conftest import LINEN, LINEN_FLAGS, tiny_config

NNX = (True, True, True)
# The saved teacher (see `teacher_dir`), as the student's backend runs it, and as scanned Linen.
SAVED_TEACHER = "{load_parameters_path: TEACHER_DIR}"
LINEN_TEACHER = (
    "{load_parameters_path: TEACHER_DIR, scan_layers: true, pure_nnx: false, enable_nnx: false, pure_nnx_decoder: false}"
)


def distill_config(**overrides):
  options = dict(warmup_steps_fraction=0.0, learning_rate=1e-2, steps=4, eval_interval=0, distill_temperature=2.0)
  return tiny_config(NNX, **{**options, **overrides})


# name -> config overrides; each is one step from the same initial student on the same batch.
RUNS = {
    "plain": dict(distill_temperature=1.0),  # no teacher: distillation's keys at their defaults (else refused)
    "alpha0": dict(teacher_overrides=SAVED_TEACHER, distill_alpha=0.0),
    "half": dict(teacher_overrides=SAVED_TEACHER, distill_alpha=0.5),
    "half-linen-teacher": dict(teacher_overrides=LINEN_TEACHER, distill_alpha=0.5),
    "self": dict(teacher_overrides="{}", distill_alpha=1.0),
    # With a feature loss too (distill_beta), on the student's own weights: every term is zero.
    "self-beta": dict(teacher_overrides="{}", distill_alpha=1.0, distill_beta=1.0, distill_feature_loss_type="l2"),
    "half-beta": dict(teacher_overrides=SAVED_TEACHER, distill_alpha=0.5, distill_beta=0.5),
    "half-beta-linen-teacher": dict(teacher_overrides=LINEN_TEACHER, distill_alpha=0.5, distill_beta=0.5),
}


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
  """A saved llama-tiny run (Linen, unscanned, from another seed than the student): the teacher."""
  root = tmp_path_factory.mktemp("distill")
  config = tiny_config(LINEN, seed=7, steps=2, scan_layers=False, eval_interval=0, base_output_directory=str(root))
  mb.train(config.replace(run_name="teacher"), progress=False)
  return root / "teacher"


@pytest.fixture(scope="module")
def steps(teacher_dir):
  out = {}
  for name, overrides in RUNS.items():
    if "teacher_overrides" in overrides:
      overrides = {
          **overrides,
          "teacher_overrides": overrides["teacher_overrides"].replace("TEACHER_DIR", str(teacher_dir)),
      }
    config = distill_config(**overrides)
    trainer = recipe.create_trainer(config)
    batch = data.make_dataset(config, "train", 4).batch(0)
    state, metrics = trainer.train_step(trainer.init_state(0), batch)
    metrics = {key: np.asarray(value) for key, value in metrics.items()}
    out[name] = dict(
        config=config, trainer=trainer, metrics=metrics, params=jax.tree.map(np.asarray, trainer.params(state))
    )
  return out


def _assert_same_step(got, want, atol):
  for key in ("loss", "grad_norm"):
    np.testing.assert_allclose(got["metrics"][key], want["metrics"][key], rtol=atol, atol=atol, err_msg=key)
  want_flat = canonical.flatten(want["params"])
  for path, value in canonical.flatten(got["params"]).items():
    np.testing.assert_allclose(value, want_flat[path], atol=atol, rtol=0, err_msg=path)


@pytest.mark.fusion_emitters  # a trained step compared to 1e-6: Adam's first update amplifies an ulp of a near-zero gradient
def test_alpha_zero_is_plain_training(steps):
  assert steps["alpha0"]["metrics"]["distill_kl"] > 0.01  # the teacher runs and disagrees, but does not count
  _assert_same_step(steps["alpha0"], steps["plain"], 1e-6)


def test_alpha_one_with_the_students_own_weights_has_zero_kl_and_zero_gradient(steps):
  metrics = steps["self"]["metrics"]
  assert abs(metrics["distill_kl"]) < 1e-6 and abs(metrics["loss"]) < 1e-6
  assert metrics["grad_norm"] < 1e-6
  assert metrics["distill_ce"] > 1.0  # the labels were there; alpha = 1 ignores them


def test_the_loss_is_alpha_t_squared_kl_plus_one_minus_alpha_cross_entropy(steps):
  metrics, config = steps["half"]["metrics"], steps["half"]["config"]
  alpha, t = config.distill_alpha, config.distill_temperature
  want = alpha * t**2 * metrics["distill_kl"] + (1 - alpha) * metrics["distill_ce"]
  np.testing.assert_allclose(metrics["loss"], want, rtol=1e-6)
  np.testing.assert_allclose(metrics["distill_ce"], steps["plain"]["metrics"]["loss"], rtol=1e-6)


def test_tiled_kl_equals_untiled_in_value_and_gradient(steps):
  config = steps["half"]["config"]
  trainer = steps["half"]["trainer"]
  teacher = trainer.loss.teacher
  model = mb.create_model(config, seed=0)
  batch = data.make_dataset(config, "train", 4).batch(0)
  teacher_forward = Forward(teacher.apply, trainer.frozen_params, None)

  def value_and_grad(tiles):
    loss = distill.Distillation(config.replace(num_vocab_tiling=tiles), teacher)

    def total(params):
      student = Forward(lambda p, _, *inputs: model.apply_with_intermediates(p, *inputs), params, None, lambda p: p)
      return loss(student, batch, teacher_forward)

    return jax.jit(jax.value_and_grad(total, has_aux=True))(model.params())

  (want, want_aux), want_grads = value_and_grad(1)
  (got, got_aux), got_grads = value_and_grad(4)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for key in ("distill_kl", "distill_ce", "z_loss"):
    np.testing.assert_allclose(got_aux[key], want_aux[key], rtol=1e-5, atol=1e-6, err_msg=key)
  want_flat = canonical.flatten(want_grads)
  for path, value in canonical.flatten(got_grads).items():
    np.testing.assert_allclose(value, want_flat[path], atol=1e-5, rtol=1e-5, err_msg=path)


def test_distill_beta_adds_beta_times_the_feature_loss_and_beta_0_is_todays_distillation(steps):
  # "half" runs with distill_beta=0 (the default): its loss is the logit distillation's alone, as checked above.
  assert "distill_feature" not in steps["half"]["metrics"]
  metrics, config = steps["half-beta"]["metrics"], steps["half-beta"]["config"]
  assert config.distill_feature_loss_type == "cosine" and metrics["distill_feature"] > 1e-3
  want = steps["half"]["metrics"]["loss"] + config.distill_beta * metrics["distill_feature"]
  np.testing.assert_allclose(metrics["loss"], want, rtol=1e-6)
  np.testing.assert_allclose(metrics["distill_kl"], steps["half"]["metrics"]["distill_kl"], rtol=1e-6)


def test_a_feature_loss_against_the_students_own_weights_is_zero_with_zero_gradient(steps):
  metrics = steps["self-beta"]["metrics"]
  assert abs(metrics["distill_feature"]) < 1e-6 and abs(metrics["loss"]) < 1e-6 and metrics["grad_norm"] < 1e-6


# name -> (the student's flags, config overrides): the feature loss against the saved teacher, its value and
# gradient taken directly (`_feature_step`), on each backend, a bridged mix, and unscanned.
FEATURE_RUNS = {
    "nnx": (NNX, dict()),
    "linen": (LINEN, dict()),
    "bridged": ((True, False, True), dict()),
    "nnx-unscanned": (NNX, dict(scan_layers=False)),
    "layer-1": (NNX, dict(distill_layer_indices=[1])),
    # The student's own weights as teacher, alpha 1: KL and feature loss are both zero, and so is the gradient.
    "self": (NNX, dict(teacher_overrides="{}", distill_alpha=1.0)),
}


def _feature_step(config):
  """(loss, aux, canonical gradient) of the distillation loss with its teacher, for `config`'s student at seed 0."""
  loss = recipe.create_loss(config)
  reference = Forward(loss.teacher.apply, loss.teacher.take_params(), None)
  model = mb.create_model(config, seed=0)
  batch = data.make_dataset(config, "train", 4).batch(0)

  def total(params):
    student = Forward(lambda p, _, *inputs: model.apply_with_intermediates(p, *inputs), params, None, lambda p: p)
    return loss(student, batch, reference)

  (value, aux), grads = jax.jit(jax.value_and_grad(total, has_aux=True))(model.params())
  unscanned = dispatch.abstract_model(config.replace(scan_layers=False)).abstract_params()
  return dict(
      config=config,
      batch=batch,
      loss=np.asarray(value),
      aux=jax.tree.map(np.asarray, aux),
      grads=jax.tree.map(np.asarray, canonical.conform(grads, unscanned, config.param_scan_axis)),
  )


@pytest.fixture(scope="module")
def features(teacher_dir):
  out = {}
  for name, (flags, overrides) in FEATURE_RUNS.items():
    options = dict(teacher_overrides=SAVED_TEACHER.replace("TEACHER_DIR", str(teacher_dir)), distill_beta=0.5)
    options = dict(warmup_steps_fraction=0.0, eval_interval=0, distill_temperature=2.0, **{**options, **overrides})
    out[name] = _feature_step(tiny_config(flags, **options))
  return out


def _assert_same_feature_step(got, want, atol):
  for key in ("distill_feature", "distill_kl", "distill_ce"):
    np.testing.assert_allclose(got["aux"][key], want["aux"][key], rtol=atol, atol=atol, err_msg=key)
  np.testing.assert_allclose(got["loss"], want["loss"], rtol=atol, atol=atol)
  want_flat = canonical.flatten(want["grads"])
  for path, value in canonical.flatten(got["grads"]).items():
    np.testing.assert_allclose(value, want_flat[path], atol=atol, rtol=0, err_msg=path)


@pytest.mark.parametrize(
    "name", ["linen", "bridged", pytest.param("nnx-unscanned", marks=pytest.mark.fusion_emitters)]  # 1e-6 exact
)
def test_the_feature_loss_and_its_gradient_are_the_same_on_linen_nnx_bridged_and_unscanned(features, name):
  assert features["nnx"]["aux"]["distill_feature"] > 1e-3  # the teacher's activations differ
  _assert_same_feature_step(features[name], features["nnx"], 1e-6)


def test_the_feature_loss_of_the_students_own_weights_is_zero_with_zero_gradient(features):
  got = features["self"]
  assert got["config"].distill_feature_loss_type == "cosine"  # "self-beta" above checks l2 in a train step
  tokens = got["aux"]["tokens"]  # per token, as the run logs them (float32 rounding: ~1e-8 a token)
  assert abs(got["aux"]["distill_feature"]) / tokens < 1e-6 and abs(got["loss"]) / tokens < 1e-6
  assert max(np.abs(g).max() for g in jax.tree.leaves(got["grads"])) / tokens < 1e-6


def _captured_out_projections(config, params, batch):
  """Each layer's attention output after its out projection, [L, B, T, D], as Flax's capture_intermediates
  records the `out` Dense of the Linen unscanned model: a path that shares nothing with the per-layer values
  the loss reads."""
  config = config.replace(**LINEN_FLAGS, scan_layers=False, distill_beta=0.0, distill_layer_indices=None)
  model = dispatch.abstract_model(config)
  params = canonical.conform(params, model.abstract_params(), config.param_scan_axis)
  inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
  _, state = model.module.apply(
      {"params": params}, *inputs, capture_intermediates=lambda module, _: module.name == "out", mutable=True
  )
  decoder = state["intermediates"]["decoder"]
  layers = range(config.num_decoder_layers)
  return np.stack([decoder[f"layers_{i}"]["self_attention"]["out"]["__call__"][0] for i in layers])


def test_the_feature_loss_compares_the_chosen_layers_out_projection_outputs_averaged_over_layers(features):
  got = features["layer-1"]
  config, batch = got["config"], got["batch"]
  teacher_config, teacher_params, _ = distill.load_teacher(config)
  student = _captured_out_projections(config, mb.create_model(config, seed=0).params(), batch)
  teacher = _captured_out_projections(teacher_config, teacher_params, batch)
  assert student.shape == (config.num_decoder_layers, 4, config.max_target_length, config.emb_dim)
  cosine = np.sum(student * teacher, -1) / (np.linalg.norm(student, axis=-1) * np.linalg.norm(teacher, axis=-1))
  mask = np.asarray(batch["targets_segmentation"]) != 0
  per_layer = [np.sum((1 - cosine[i]) * mask) for i in range(config.num_decoder_layers)]  # token sums, as logged
  assert abs(per_layer[0] - per_layer[1]) > 0.05 * per_layer[1]  # the wrong layer would fail below
  np.testing.assert_allclose(got["aux"]["distill_feature"], per_layer[1], rtol=1e-5)
  np.testing.assert_allclose(features["nnx"]["aux"]["distill_feature"], np.mean(per_layer), rtol=1e-5)  # null: all
  # The loss (a sum over tokens, as the feature term) adds beta times it to the same logit distillation.
  beta, nnx = config.distill_beta, features["nnx"]
  want = nnx["loss"] - beta * nnx["aux"]["distill_feature"] + beta * per_layer[1]
  np.testing.assert_allclose(got["loss"], want, rtol=1e-5)


@pytest.mark.parametrize("preset", ["llama-tiny", "deepseek3-tiny", "gpt3-tiny", "gemma-tiny", "olmo2-tiny"])
def test_only_a_feature_loss_makes_each_attention_return_its_out_projection_output(preset):
  # Each attention class (Llama's, MLA across DeepSeek's two stacks, GPT-3's, Gemma's, OLMo 2's), on both backends.
  key = f"decoder/{attention.OUT_PROJECTION}"
  for flags in (NNX, LINEN):
    for beta in (0.0, 0.5):
      config = mb.load_config(preset, **dict(zip(LINEN_FLAGS, flags)), distill_beta=beta)
      model = dispatch.abstract_model(config)
      _, intermediates = jax.eval_shape(model.apply_with_intermediates, model.abstract_params(), np.zeros((2, 8), int))
      assert (key in intermediates) == bool(beta), (flags, beta)
      if beta:  # [layers, B, T, emb_dim]
        assert intermediates[key].shape == (config.num_decoder_layers, 2, 8, config.emb_dim), flags


def test_an_nnx_step_with_a_feature_loss_keeps_its_states_tree(steps):
  # NNX: the activations are values the layers return, never state the step writes back (MaxText pops its sown
  # intermediates for this), so a second step gets the same tree and graph.
  trainer, config = steps["half-beta"]["trainer"], steps["half-beta"]["config"]
  batch = data.make_dataset(config, "train", 4).batch(0)
  state = trainer.init_state(0)
  after, _ = trainer.train_step(state, batch)
  assert jax.tree.structure(after) == jax.tree.structure(state)


def test_feature_distillation_refuses_layers_and_models_it_cannot_compare_naming_the_key():
  with pytest.raises(ConfigError, match=r"distill_layer_indices=\[2\]: \[2\] outside the model's layers.*in 0\.\.1"):
    distill_config(teacher_overrides="{}", distill_beta=0.5, distill_layer_indices=[2])
  with pytest.raises(ConfigError, match=r"distill_layer_indices=\[-1\]: \[-1\] outside"):
    distill_config(teacher_overrides="{}", distill_beta=0.5, distill_layer_indices="[-1]")
  with pytest.raises(ConfigError, match=r"distill_layer_indices=\[0\] picks the layers .* distill_beta=0 turns off"):
    distill_config(teacher_overrides="{}", distill_layer_indices=[0])
  with pytest.raises(ConfigError, match="'distill_layer_indices' expects a list of integers"):
    distill_config(distill_layer_indices="first")
  shallow = "{base_num_decoder_layers: 1}"
  with pytest.raises(ConfigError, match=r"distill_layer_indices=\[1\]: \[1\] past the teacher's layers .* in 0\.\.0"):
    recipe.create_loss(distill_config(teacher_overrides=shallow, distill_beta=0.5, distill_layer_indices=[1]))
  with pytest.raises(ConfigError, match="distill_layer_indices=null compares every layer.*has 1 layers.*student.* 2"):
    recipe.create_loss(distill_config(teacher_overrides=shallow, distill_beta=0.5))
  assert families.lookup("gemma2").stacks[0].sublayers
  with pytest.raises(ConfigError, match="decoder_block='gemma2'.*blocks of 2 layers"):
    mb.load_config("gemma2-tiny", distill_beta=0.5, teacher_overrides="{}")
  with pytest.raises(
      ConfigError, match="distill_beta=0.5 are read only by distillation from a teacher, and this run has none"
  ):
    recipe.create_loss(distill_config(distill_beta=0.5))
  with pytest.raises(ConfigError, match="distill_beta=0.5 with pipeline parallelism"):
    distill_config(teacher_overrides="{}", distill_beta=0.5, ici_pipeline_parallelism=2)


def test_feature_losses_match_their_formulas():
  s, t = np.array([[3.0, 4.0], [1.0, 0.0]], np.float32), np.array([[6.0, 8.0], [0.0, 2.0]], np.float32)
  np.testing.assert_allclose(distill.feature_loss(s, t, "cosine"), [0.0, 1.0], atol=1e-6)
  np.testing.assert_allclose(distill.feature_loss(s, t, "l2"), [(9 + 16) / 2, (1 + 4) / 2], rtol=1e-6)


def test_a_feature_loss_against_a_teacher_of_another_width_or_offline_logits_is_refused():
  with pytest.raises(ConfigError, match="emb_dim 64.*emb_dim 128|emb_dim 128.*emb_dim 64"):
    recipe.create_loss(distill_config(teacher_overrides="{base_emb_dim: 128}", distill_beta=0.5))
  with pytest.raises(ConfigError, match="only a teacher in the step has"):
    distill_config(distill_logits_path="/nowhere", distill_beta=0.5)


@pytest.mark.fusion_emitters  # trained steps compared to 1e-6
def test_a_linen_teacher_equals_an_nnx_teacher_with_a_feature_loss(steps):
  _assert_same_step(steps["half-beta-linen-teacher"], steps["half-beta"], 1e-6)


def test_a_linen_unscanned_teacher_equals_an_nnx_teacher_for_an_nnx_student(steps):
  assert not steps["half-linen-teacher"]["trainer"].loss.teacher.config.pure_nnx
  _assert_same_step(steps["half-linen-teacher"], steps["half"], 1e-6)


def test_a_teacher_of_another_vocabulary_is_refused_naming_both_sizes():
  with pytest.raises(
      ConfigError, match=r"teacher's vocabulary \(50257 tokens, gpt2\) is not the student's \(256 tokens, llama-tiny"
  ):
    distill.load_teacher(distill_config(teacher_overrides="{model_name: gpt2}"))
  with pytest.raises(ConfigError, match="must be a mapping"):
    distill.load_teacher(distill_config(teacher_overrides="llama-small"))


def test_the_teacher_is_read_from_its_run_and_distillation_trains_with_decreasing_loss(steps, teacher_dir, tmp_path):
  config = steps["half"]["config"]
  teacher_config, params, source = distill.load_teacher(config)
  # Its own run's config.yml (unscanned), with the student's backend flags (its overrides could set its own).
  assert teacher_config.run_name == "teacher" and not teacher_config.scan_layers and teacher_config.pure_nnx
  assert teacher_config.teacher_overrides == "" and params is not None and source == str(teacher_dir)

  config = config.replace(base_output_directory=str(tmp_path), run_name="student")
  losses = [r["loss"] for r in mb.train(config, trainer=steps["half"]["trainer"], progress=False)]
  assert losses[-1] < losses[0], losses


def test_the_teacher_keeps_no_copy_of_the_parameters_the_trainer_placed(steps):
  for name in ("half", "half-linen-teacher"):
    trainer = steps[name]["trainer"]
    teacher = trainer.loss.teacher
    held = (
        jax.tree.leaves(teacher.model.params()) if teacher.config.pure_nnx else [getattr(teacher.model, "_params", None)]
    )
    # An abstract model: shapes only (NNX), or no tree at all (Linen); the placed tree is the one copy.
    assert all(isinstance(leaf, (jax.ShapeDtypeStruct, type(None))) for leaf in held), name
    assert teacher._params is None and jax.tree.leaves(trainer.frozen_params), name
    with pytest.raises(RuntimeError, match="handed over already"):
      teacher.take_params()


def test_compile_lowers_on_the_teachers_shapes_without_reading_or_placing_its_parameters(steps, monkeypatch):
  def refuse(self):
    raise AssertionError("maxbridge compile asked for the teacher's parameters")

  monkeypatch.setattr(distill.Teacher, "take_params", refuse)
  result = aot.compile_train_step(steps["half"]["config"])
  assert result["flops"] > 0 and result["argument_bytes"] > 0


def test_a_resume_is_refused_when_the_teacher_changed_and_goes_on_with_the_same_one(steps, tmp_path):
  trainer = steps["self"]["trainer"]
  config = steps["self"]["config"].replace(base_output_directory=str(tmp_path), run_name="student", checkpoint_period=2)
  mb.train(config, trainer=trainer, until_step=2, progress=False)
  recorded = json.loads((tmp_path / "student" / hooks.TEACHER_FILE).read_text())
  assert recorded["base"] == f"seed {config.seed}"
  # The same teacher_overrides ('{}': the student's own model at the student's seed) with other values.
  with pytest.raises(CheckpointError, match=r"its distillation teacher was seed 0 .* not seed 1 .*\(teacher_overrides,"):
    mb.train(config.replace(seed=1), progress=False)
  # Another teacher, or another mix of KL and cross-entropy, is another objective: refused, naming the key.
  for key, value in (("teacher_overrides", "{seed: 1}"), ("distill_alpha", 0.5), ("distill_temperature", 1.0)):
    with pytest.raises(CheckpointError, match=f"{key}: "):
      mb.train(config.replace(**{key: value}), progress=False)
  records = mb.train(config, trainer=trainer, progress=False)
  assert [r["step"] for r in records] == [2, 3] and json.loads(
      (tmp_path / "student" / hooks.TEACHER_FILE).read_text()
  ) == recorded


def test_offline_logits_with_k_the_whole_vocabulary_train_as_the_teacher_in_the_step(steps, tmp_path):
  config = steps["half"]["config"]
  out = distill.write_logits(config, tmp_path / "logits", top_k=config.vocab_size, steps=config.steps, rows=4)
  assert sorted(p.name for p in out.iterdir()) == ["meta.json"] + [f"step_{i:08d}.npz" for i in range(4)]
  offline = config.replace(distill_logits_path=str(out))
  trainer = recipe.create_trainer(offline)
  assert trainer.loss.teacher is None  # no teacher is built, read or run
  # `maxbridge compile` lowers on these (the file's k, any batch), reading no logits.
  assert distill.offline_shapes(offline, 8)["teacher_values"].shape == (8, config.max_target_length, 256)
  batch = {
      **data.make_dataset(offline, "train", 4).batch(0),
      **distill.OfflineLogits(offline, 4, data.make_dataset(offline, "train", 4)).batch(0),
  }
  state, metrics = trainer.train_step(trainer.init_state(0), batch)
  got = dict(metrics={key: np.asarray(value) for key, value in metrics.items()}, params=trainer.params(state))
  np.testing.assert_allclose(got["metrics"]["distill_kl"], steps["half"]["metrics"]["distill_kl"], rtol=1e-5)
  _assert_same_step(got, steps["half"], 1e-5)


def test_offline_logits_written_for_other_batches_or_another_vocabulary_are_refused_naming_the_path(steps, tmp_path):
  config = steps["self"]["config"]
  out = distill.write_logits(config, tmp_path / "logits", top_k=8, steps=2, rows=4)
  offline = config.replace(distill_logits_path=str(out))
  batches = data.make_dataset(offline, "train", 4)
  with pytest.raises(ConfigError, match=rf"distill_logits_path={out} was written for other batches: steps 2 \(the run"):
    distill.OfflineLogits(offline, 4, batches)
  with pytest.raises(ConfigError, match=r"rows 4 \(the run's: 8\); steps 2"):
    hooks.Data(offline)  # the run's own source: 8 rows a step on one device
  with pytest.raises(ConfigError, match=r"vocab_size 256 \(the run's: 512\)"):
    distill.OfflineLogits(offline.replace(vocab_size=512, steps=2), 4, batches)
  with pytest.raises(ConfigError, match=rf"distill_logits_path={tmp_path}: no meta.json"):
    distill.OfflineLogits(offline.replace(distill_logits_path=str(tmp_path)), 4, batches)
  with pytest.raises(FileExistsError, match="exists"):
    distill.write_logits(config, out, top_k=8, steps=2, rows=4)


def _tamper(folder, **changes):
  meta = json.loads((folder / "meta.json").read_text())
  for key, value in changes.items():
    if value is None:
      del meta[key]
    else:
      meta[key] = value
  (folder / "meta.json").write_text(json.dumps(meta))


def test_offline_logits_of_another_seed_or_dataset_are_refused_naming_each_key_and_both_values(steps, tmp_path):
  config = steps["self"]["config"].replace(steps=2)
  out = distill.write_logits(config, tmp_path / "logits", top_k=8, steps=2, rows=8)
  offline = config.replace(distill_logits_path=str(out))
  source = hooks.Data(offline)  # the run's own source, 8 rows a step on one device: the settings agree
  assert source.batch(1, None)[0]["teacher_values"].shape == (8, config.max_target_length, 8)
  with pytest.raises(
      ConfigError, match=rf"distill_logits_path={out} was written for other batches: seed 0 \(the run's: 7\)"
  ):
    hooks.Data(offline.replace(seed=7))
  with pytest.raises(ConfigError, match=r"dataset_type 'embedded' \(the run's: 'synthetic'\)"):
    hooks.Data(offline.replace(dataset_type="synthetic"))
  # Every key that shapes the batches is recorded and compared: those a resume may not change, and the seed.
  assert set(hooks.Data.fixed_keys) | {"seed", "max_target_length", "vocab_size"} <= set(distill.PROVENANCE_KEYS)
  batches = data.make_dataset(offline, "train", 8)
  recorded = json.loads((out / "meta.json").read_text())["data"]
  for key in distill.PROVENANCE_KEYS:
    _tamper(out, data={**recorded, key: "elsewhere"})
    with pytest.raises(ConfigError, match=rf"{key} 'elsewhere' \(the run's: "):
      distill.OfflineLogits(offline, 8, batches)
  _tamper(out, data=recorded)
  # A Grain source, read once in order, is checked step by step as the loop reads it.
  grain_like = distill.OfflineLogits(offline, 8, types.SimpleNamespace(stateful=True))
  grain_like.check_tokens(1, batches.batch(1))
  with pytest.raises(ConfigError, match=r"the tokens of step 1 \(the first of the run's that differs\)"):
    grain_like.check_tokens(1, data.make_dataset(offline.replace(seed=7), "train", 8).batch(1))
  # Logits written before the record: refused, naming what is missing.
  _tamper(out, data=None, tokens_sha256=None)
  with pytest.raises(ConfigError, match=r"does not record 'data' or 'tokens_sha256' .* write them again"):
    hooks.Data(offline)


def test_offline_logits_of_another_file_or_of_a_file_changed_in_place_are_refused(steps, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  for name, word in (("a.jsonl", "alpha"), ("b.jsonl", "beta")):
    (tmp_path / name).write_text("".join(json.dumps({"text": f"{word} {i} " * 9}) + "\n" for i in range(40)))
  config = steps["self"]["config"].replace(steps=2, dataset_type="text", dataset_path="a.jsonl")
  out = distill.write_logits(config, tmp_path / "logits", top_k=8, steps=2, rows=8)
  # The same file spelled from another directory is the same data.
  offline = config.replace(distill_logits_path=str(out), dataset_path=str(tmp_path / "a.jsonl"))
  hooks.Data(offline)
  with pytest.raises(ConfigError, match=r"dataset_path '\S+/a.jsonl' \(the run's: '\S+/b.jsonl'\)"):
    hooks.Data(offline.replace(dataset_path=str(tmp_path / "b.jsonl")))
  (tmp_path / "a.jsonl").write_text((tmp_path / "b.jsonl").read_text())
  with pytest.raises(ConfigError, match=r"the tokens of step 0 \(the first of the run's that differs\) have sha256"):
    hooks.Data(offline)
