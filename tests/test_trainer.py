"""The one train step: pluggable losses, the reference pass, the after-update hook; models that can be freed."""

import gc
import weakref

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxbridge as mb
from maxbridge.training import data
from maxbridge.models import dispatch
from maxbridge.training.loss import CrossEntropy, Loss, StepPolicy
from maxbridge.training import recipe
from conftest import tiny_config

BACKENDS = {"linen": (False, False, False), "nnx": (True, True, True)}


def first_batch(config, rows=4) -> dict:
  return data.make_dataset(config, "train", rows).batch(0)


def hand_cross_entropy(logits, targets) -> np.ndarray:
  """Per-token cross-entropy [B, T] in float64 numpy, independent of ops.losses."""
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
  return -np.take_along_axis(log_probs, np.asarray(targets)[..., None], -1)[..., 0]


class CompletionOnly(Loss):
  """Cross-entropy on the tokens an extra batch key marks (as SFT trains on completions only)."""

  batch_keys = (*CrossEntropy.batch_keys, "completion_mask")

  def __call__(self, forward, batch, reference=None):
    logits, _ = forward(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
    per_token = -jnp.take_along_axis(log_probs, batch["targets"][..., None], -1)[..., 0]
    mask = ((batch["targets_segmentation"] != 0) & (batch["completion_mask"] != 0)).astype(jnp.float32)
    return jnp.sum(per_token * mask), {"tokens": jnp.sum(mask)}


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_loss_with_an_extra_batch_key_trains_and_matches_a_hand_computation(backend):
  config = tiny_config(BACKENDS[backend])
  trainer = recipe.create_trainer(config, loss=CompletionOnly())
  batch = first_batch(config)
  length = batch["inputs"].shape[1]
  batch["completion_mask"] = np.broadcast_to(np.arange(length) >= length // 2, batch["inputs"].shape).astype(np.int32)

  state = trainer.init_state(0)
  params = jax.tree.map(np.array, trainer.params(state))
  state, metrics = trainer.train_step(state, batch)

  logits = dispatch.create_model(config, params=params).logits(
      batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"]
  )
  mask = (batch["targets_segmentation"] != 0) & (batch["completion_mask"] != 0)
  want = (hand_cross_entropy(logits, batch["targets"]) * mask).sum() / mask.sum()
  assert float(metrics["tokens"]) == mask.sum() < (batch["targets_segmentation"] != 0).sum()
  np.testing.assert_allclose(metrics["loss"], want, rtol=1e-5)
  losses = [float(metrics["loss"])]
  for _ in range(3):
    state, metrics = trainer.train_step(state, batch)
    losses.append(float(metrics["loss"]))
  assert losses[-1] < losses[0] - 0.1, f"the loss should fall on a repeated batch: {losses}"

  del batch["completion_mask"]
  with pytest.raises(KeyError, match=r"CompletionOnly needs batch keys .*the batch lacks \['completion_mask'\]"):
    trainer.train_step(state, batch)


def one_step(config, **hooks) -> dict:
  """params, metrics and optimizer state (as numpy) after one step from seed 0 on the first batch."""
  trainer = recipe.create_trainer(config, **hooks)
  state, metrics = trainer.train_step(trainer.init_state(0), first_batch(config))
  out = {"params": trainer.params(state), "metrics": metrics, "opt_state": trainer.to_checkpoint(state)["opt_state"]}
  return jax.tree.map(np.asarray, out)


@pytest.fixture(scope="module")
def plain_step():
  """The default loss's step per backend, the baseline the hooks are measured against."""
  return {backend: one_step(tiny_config(flags)) for backend, flags in BACKENDS.items()}


class WithReference(CrossEntropy):
  """Cross-entropy counted twice, once through the reference pass: its value shows, its gradient must not."""

  frozen = StepPolicy()

  def __call__(self, forward, batch, reference=None):
    loss, aux = super().__call__(forward, batch)
    reference_loss, _ = super().__call__(reference, batch)
    return loss + reference_loss, aux


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_the_reference_pass_adds_to_the_loss_but_not_to_the_gradient(backend, plain_step):
  plain, ref = plain_step[backend], one_step(tiny_config(BACKENDS[backend]), loss=WithReference())
  np.testing.assert_allclose(ref["metrics"]["loss"], 2 * plain["metrics"]["loss"], rtol=1e-6)
  np.testing.assert_allclose(ref["metrics"]["grad_norm"], plain["metrics"]["grad_norm"], rtol=1e-6)
  for a, b in zip(jax.tree.leaves(ref["params"]), jax.tree.leaves(plain["params"])):
    np.testing.assert_allclose(a, b, atol=1e-6)


def clip_all(params, metrics):
  return jax.tree.map(lambda x: jnp.clip(x, -0.02, 0.02), params)


def test_after_update_acts_on_canonical_parameters_the_same_on_both_backends(plain_step):
  hooked = {backend: one_step(tiny_config(flags), after_update=clip_all) for backend, flags in BACKENDS.items()}
  for backend, got in hooked.items():
    plain = plain_step[backend]
    for key in ("loss", "grad_norm"):
      assert got["metrics"][key] == plain["metrics"][key], f"{backend}: {key}"
    want = clip_all(plain["params"], None)
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(want)[0], jax.tree.leaves(got["params"])):
      np.testing.assert_array_equal(b, a, err_msg=f"{backend}: {jax.tree_util.keystr(path)}")
    # The hook edits parameters only: the optimizer state is the unhooked one.
    for a, b in zip(jax.tree.leaves(got["opt_state"]), jax.tree.leaves(plain["opt_state"])):
      np.testing.assert_array_equal(a, b)
  assert max(np.abs(x).max() for x in jax.tree.leaves(hooked["nnx"]["params"])) <= 0.02
  for a, b in zip(jax.tree.leaves(hooked["nnx"]["params"]), jax.tree.leaves(hooked["linen"]["params"])):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_train_refuses_a_trainer_built_for_another_config(tmp_path):
  config = tiny_config(base_output_directory=str(tmp_path), run_name="r", steps=2)
  trainer = recipe.create_trainer(config.replace(learning_rate=1.0))
  with pytest.raises(ValueError, match=r"differs in learning_rate \(trainer: 1.0, run: 0.00"):
    mb.train(config, trainer=trainer, progress=False)
  assert not (tmp_path / "r").exists(), "nothing is written for a refused trainer"


@pytest.mark.parametrize("backend", list(BACKENDS))
def test_a_model_is_freed_after_logits_and_generate(backend, tokens):
  model = mb.create_model(tiny_config(BACKENDS[backend]), seed=0)
  model.logits(tokens)
  model.generate(tokens[:, :4], max_new_tokens=2)
  freed = weakref.ref(model)
  del model
  gc.collect()
  assert freed() is None, "something still holds the model (and so its parameters)"


def test_an_nnx_model_holding_a_non_param_variable_still_runs(tokens):
  config = tiny_config(BACKENDS["nnx"])
  model = mb.create_model(config, seed=0)
  want = model.logits(tokens)
  model.module.calls = nnx.Variable(jnp.zeros((), jnp.int32))
  # Un-jitted, so that this call traces the module as it is now.
  np.testing.assert_allclose(model.apply(model.params(), tokens), want, atol=1e-6)
  assert "calls" not in model.params() and int(model.module.calls[...]) == 0


@pytest.mark.parametrize("backend", ["linen", "nnx"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_a_fresh_and_a_resumed_state_run_one_compiled_train_step(backend, lora):
  """A fresh state's leaves have the types of a restored one, weak types included: a resumed run compiles nothing new."""
  flags = (True, True, True) if backend == "nnx" else (False, False, False)
  trainer = recipe.create_trainer(tiny_config(flags, **({"lora_rank": 4} if lora else {})))
  fresh = trainer.init_state(0)
  tree = trainer.to_checkpoint(fresh)
  # As `mb.train` resumes: LoRA checkpoints hold the adapters only, put back into a state holding the base.
  resumed = trainer.from_checkpoint(tree) if trainer.saves_params else trainer.with_checkpoint(fresh, tree)

  def types(state):
    state = nnx.state(state) if isinstance(state, nnx.Module) else state
    return jax.tree.map(lambda x: (x.dtype, x.shape, jax.typeof(x).weak_type), state)

  assert types(fresh) == types(resumed)


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_the_nnx_state_between_steps_holds_arrays_not_variables(lora):
  """`jax.jit` flattens the state on every call and builds its output again: a Variable per leaf is host time
  each step (NNXTrainer's docstring has the figures), so the state a step takes and returns is pure."""
  trainer = recipe.create_trainer(tiny_config((True, True, True), **({"lora_rank": 4} if lora else {})))
  fresh = trainer.init_state(0)
  stepped, _ = trainer.train_step(trainer.init_state(0), first_batch(trainer.config))
  resumed = trainer.with_checkpoint(fresh, trainer.to_checkpoint(fresh))
  for name, state in {
      "abstract": trainer.abstract_state(),
      "fresh": fresh,
      "stepped": stepped,
      "resumed": resumed,
  }.items():
    variables = [
        x for x in jax.tree.leaves(state, is_leaf=lambda x: isinstance(x, nnx.Variable)) if isinstance(x, nnx.Variable)
    ]
    assert not variables, f"{name} state holds {len(variables)} nnx.Variable(s), e.g. {type(variables[0]).__name__}"
    assert len(jax.tree.leaves(state)) == len(jax.tree.leaves(trainer.abstract_state())), name
