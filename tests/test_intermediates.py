"""Nothing sown in a forward pass leaks into the train state, its shardings, the compiled step or a checkpoint.

Vocabulary tiling (it reads the sown hidden states) and QK-Clip (it reads the
sown max logits) are both on, with a threshold low enough that heads are
clipped, so every kind of sown value is made in every step.
"""

import jax
import numpy as np
import pytest

import maxbridge as mb
from conftest import FLAG_COMBINATIONS, flag_id, tiny_config
from maxbridge.training import data
from maxbridge.training.loop import step_key
from maxbridge.training import recipe

FEATURES = dict(num_vocab_tiling=2, use_qk_clip=True, qk_clip_threshold=0.5)
SOWN = ("intermediates", "Intermediate", "hidden_states", "max_logits", "moe_lb_loss")
LINEN, NNX = (False, False, False), (True, True, True)


def _leaked(tree) -> list[str]:
  paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
  return [path for path in paths if any(name in path for name in SOWN)]


@pytest.fixture(scope="module")
def batch():
  return data.make_dataset(tiny_config(), "train", 4).batch(0)


@pytest.mark.parametrize("flags", FLAG_COMBINATIONS, ids=flag_id)
def test_no_sown_value_reaches_the_state_its_shardings_the_step_or_the_checkpoint(flags, batch):
  trainer = recipe.create_trainer(tiny_config(flags, **FEATURES))
  state = trainer.init_state(0)
  stepped, metrics = trainer.train_step(state, trainer.shard_batch(batch))
  assert float(metrics["maxima"]["max_logits"].max()) > FEATURES["qk_clip_threshold"], "the step should have clipped"
  # The step's output tree is its input tree: it stripped what the forward pass sowed.
  assert jax.tree.structure(stepped) == jax.tree.structure(state)
  trees = {
      "abstract state": trainer.abstract_state(),
      "state shardings": trainer.state_shardings,
      "state after a step": stepped,
      "checkpoint": trainer.to_checkpoint(stepped),
      "checkpoint target": trainer.checkpoint_target(),
  }
  for name, tree in trees.items():
    assert not _leaked(tree), (name, _leaked(tree))
  if flags[0]:  # NNX: the graph definition the step is compiled for holds no Intermediate either
    assert not [name for name in SOWN if name in repr(trainer.graphdef)]


def test_a_linen_run_resumed_with_the_nnx_flags_continues_the_same_losses(tmp_path):
  trainers = {}

  def run(name, flags, until_step=None):
    config = tiny_config(
        flags,
        base_output_directory=str(tmp_path),
        run_name=name,
        steps=4,
        checkpoint_period=2,
        eval_interval=0,
        **FEATURES,
    )
    trainer = trainers.setdefault(step_key(config), recipe.create_trainer(config))
    records = list(mb.train(config, trainer=trainer, until_step=until_step, progress=False))
    return [(r["loss"], r["max_logits"]) for r in records]

  whole = run("whole", LINEN)
  head = run("split", LINEN, until_step=2)
  tail = run("split", NNX)
  assert len(head) == 2 and len(tail) == 2
  np.testing.assert_allclose(head + tail, whole, rtol=1e-5)
  assert max(logit for _, logit in whole) > FEATURES["qk_clip_threshold"], "QK-Clip should have had work to do"


@pytest.mark.parametrize("flags", [LINEN, NNX], ids=["linen", "nnx"])
def test_qk_clip_under_gradient_accumulation_uses_the_max_over_micro_batches(flags, batch):
  """Two micro-batches clip exactly as the whole batch does: the max logit is a max over both."""
  results = []
  for micro in (1, 2):
    trainer = recipe.create_trainer(tiny_config(flags, gradient_accumulation_steps=micro, **FEATURES))
    state, metrics = trainer.train_step(trainer.init_state(0), trainer.shard_batch(batch))
    results.append((trainer.params(state), metrics))
  (whole_params, whole), (micro_params, micro) = results
  np.testing.assert_allclose(micro["maxima"]["max_logits"], whole["maxima"]["max_logits"], rtol=1e-6)
  np.testing.assert_allclose(micro["loss"], whole["loss"], rtol=1e-6)
  for (path, want), got in zip(jax.tree_util.tree_flatten_with_path(whole_params)[0], jax.tree.leaves(micro_params)):
    np.testing.assert_allclose(got, want, atol=1e-6, rtol=0, err_msg=jax.tree_util.keystr(path))
