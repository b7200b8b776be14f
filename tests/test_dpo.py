"""DPO: preference pairs packed in step, the sigmoid loss with label smoothing against a hand
computation, identical metrics on Linen, NNX and a bridged mix, and a resume across a flag flip."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

import maxbridge as mb
from maxbridge.training import data
from maxbridge.core.config import ConfigError
from maxbridge.training.loss import Forward
from maxbridge.training.posttrain import dpo
from maxbridge.training import recipe
from conftest import tiny_config

BACKENDS = {"linen": (False, False, False), "nnx": (True, True, True), "mix": (True, False, True)}
METRICS = ("loss", "grad_norm", "reward_accuracy", "chosen_rewards", "rejected_rewards", "margins")


def test_pairs_are_packed_in_step_with_completion_only_targets():
  pairs = [dpo.pair([1, 2], [3], [4, 5]), dpo.pair([6], [7, 8], [9]), dpo.pair([1, 1, 1], [2], [3])]
  rows = dpo.pack_pairs(pairs, 5)
  # Pair 1 (chosen 3 tokens) does not fit beside pair 0 (3 tokens) in 5: a new row on both sides,
  # although its rejected side (2 tokens) would have fitted beside pair 0's (4)? No: 4 + 2 > 5 too.
  np.testing.assert_array_equal(rows["chosen_inputs"], [[1, 2, 3, 0, 0], [6, 7, 8, 0, 0], [1, 1, 1, 2, 0]])
  np.testing.assert_array_equal(rows["rejected_inputs"], [[1, 2, 4, 5, 0], [6, 9, 0, 0, 0], [1, 1, 1, 3, 0]])
  np.testing.assert_array_equal(rows["chosen_targets_segmentation"], [[0, 1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0]])
  np.testing.assert_array_equal(
      rows["rejected_targets_segmentation"], [[0, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 1, 0, 0]]
  )


def hand_dpo(policy, reference, pairs, rows, beta, smoothing):
  """Per-pair (loss, chosen reward, rejected reward) in float64 numpy, from each pair's own tokens."""

  def log_prob(logits, side, row, start, prompt, completion):
    logits = np.asarray(logits, np.float64)[side * len(rows["chosen_inputs"]) + row]
    log_softmax = (
        logits
        - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True))
        - logits.max(-1, keepdims=True)
    )
    # Completion token j is predicted at the position before it.
    return sum(log_softmax[start + len(prompt) + j - 1, token] for j, token in enumerate(completion))

  out = []
  for i, ((chosen_tokens, chosen_mask), (rejected_tokens, rejected_mask)) in enumerate(pairs):
    prompt = list(chosen_tokens[~chosen_mask])
    rewards = []
    for side, (tokens, mask) in enumerate(((chosen_tokens, chosen_mask), (rejected_tokens, rejected_mask))):
      completion = list(tokens[mask])
      row, start = _where(rows[f"{dpo.SIDES[side]}_inputs_segmentation"], i)
      rewards.append(
          beta
          * (
              log_prob(policy, side, row, start, prompt, completion)
              - log_prob(reference, side, row, start, prompt, completion)
          )
      )
    z = rewards[0] - rewards[1]
    log_sigmoid = lambda x: -np.log1p(np.exp(-x))  # noqa: E731
    out.append((-(1 - smoothing) * log_sigmoid(z) - smoothing * log_sigmoid(-z), *rewards))
  return np.array(out)


def _where(segmentation, index):
  """(row, start) of pair `index` on one side, counting segments row by row."""
  seen = 0
  for row, segments in enumerate(segmentation):
    count = segments.max()
    if index < seen + count:
      return row, int(np.argmax(segments == index - seen + 1))
    seen += count
  raise IndexError(index)


def test_the_dpo_loss_on_hand_computed_log_probabilities_equals_the_formula():
  rng = np.random.default_rng(0)
  pairs = [
      dpo.pair(list(rng.integers(0, 8, n)), list(rng.integers(0, 8, 2)), list(rng.integers(0, 8, 3)))
      for n in (1, 2, 3, 4)
  ]
  rows = dpo.pack_pairs(pairs, 12)
  shape = (2 * len(rows["chosen_inputs"]), 12, 8)
  policy, reference = rng.normal(size=shape).astype(np.float32), rng.normal(size=shape).astype(np.float32)
  # Fixed logits stand in for a model: the loss sees only what a forward pass returns.
  forward = lambda logits: Forward(lambda p, f, *inputs: (jnp.asarray(logits), {}), None, None)  # noqa: E731
  beta, smoothing = 0.5, 0.2
  loss, aux = dpo.DPO(beta, smoothing)(forward(policy), {k: jnp.asarray(v) for k, v in rows.items()}, forward(reference))
  want = hand_dpo(policy, reference, pairs, rows, beta, smoothing)
  assert float(aux["tokens"]) == len(pairs)
  np.testing.assert_allclose(float(loss), want[:, 0].sum(), rtol=1e-5)
  np.testing.assert_allclose(float(aux["chosen_rewards"]), want[:, 1].sum(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(aux["rejected_rewards"]), want[:, 2].sum(), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(float(aux["margins"]), (want[:, 1] - want[:, 2]).sum(), rtol=1e-5, atol=1e-6)
  assert float(aux["reward_accuracy"]) == (want[:, 1] > want[:, 2]).sum()
  with pytest.raises(ValueError, match="DPO needs a reference model"):
    dpo.DPO()(forward(policy), rows)


def dpo_config(flags, **overrides):
  return tiny_config(
      flags,
      use_dpo=True,
      dpo_beta=0.5,
      dpo_label_smoothing=0.1,
      steps=3,
      per_device_batch_size=4,
      learning_rate=1e-3,
      warmup_steps_fraction=0.0,
      eval_interval=0,
      checkpoint_period=2,
      **overrides,
  )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
  """Three DPO steps via train() per flag combination (one trainer each, reused below)."""
  root = tmp_path_factory.mktemp("dpo")
  trainers, records = {}, {}
  for name, flags in BACKENDS.items():
    config = dpo_config(flags, base_output_directory=str(root), run_name=name, enable_checkpointing=False)
    trainers[name] = recipe.create_trainer(config)
    records[name] = mb.train(config, trainer=trainers[name], progress=False)
  return root, trainers, records


def test_dpo_logs_identical_metrics_on_linen_nnx_and_a_bridged_mix(runs):
  root, _, records = runs
  logged = [json.loads(line) for line in (root / "linen" / "metrics.jsonl").read_text().splitlines()]
  assert logged == records["linen"] and set(METRICS) <= set(logged[0])
  # The policy starts as the reference: every reward 0, the loss log 2.
  assert logged[0]["margins"] == 0 and logged[0]["reward_accuracy"] == 0
  np.testing.assert_allclose(logged[0]["loss"], np.log(2), rtol=1e-6)
  assert logged[-1]["chosen_rewards"] != 0 and logged[-1]["loss"] != logged[0]["loss"], "the policy should have moved"
  for name in ("nnx", "mix"):
    for want, got in zip(records["linen"], records[name], strict=True):
      for key in METRICS:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=f"{name} step {got['step']}: {key}")


def test_a_dpo_run_resumes_across_a_flag_flip_against_the_same_reference(runs):
  root, trainers, records = runs
  mb.train(
      dpo_config(BACKENDS["linen"], base_output_directory=str(root), run_name="flip"),
      trainer=trainers["linen"],
      until_step=2,
      progress=False,
  )
  # The checkpoint holds the policy only; the NNX run rebuilds the reference from the seed. Had it
  # taken the resumed policy instead, step 2's rewards would all be 0.
  resumed = mb.train(
      dpo_config(BACKENDS["nnx"], base_output_directory=str(root), run_name="flip"),
      trainer=trainers["nnx"],
      progress=False,
  )
  assert [r["step"] for r in resumed] == [2]
  for key in METRICS:
    np.testing.assert_allclose(resumed[0][key], records["linen"][2][key], rtol=1e-5, atol=1e-6, err_msg=key)


def test_bad_preference_data_and_config_are_refused_with_clear_errors(tmp_path):
  path = tmp_path / "prefs.jsonl"
  path.write_text(
      json.dumps({"prompt": "1+1=", "rejected": "3"}) + "\n" + json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"})
  )
  config = tiny_config(
      use_dpo=True, dataset_type="sft", dataset_path=str(path), base_output_directory=str(tmp_path / "out")
  )
  with pytest.raises(ValueError, match=r"prefs.jsonl:1: a preference row needs .*missing or not a string: \['chosen'\]"):
    mb.train(config, progress=False)
  assert not (tmp_path / "out").exists(), "a run that cannot read its data must write nothing"
  with pytest.raises(ConfigError, match=r"'dpo_label_smoothing' = 0.7 is invalid; it must be in \[0, 0.5\]"):
    tiny_config(use_dpo=True, dpo_label_smoothing=0.7)
  with pytest.raises(ConfigError, match="use_dpo=true reads preference pairs: dataset_type must be 'sft'"):
    tiny_config(use_dpo=True, dataset_type="synthetic")


def test_a_dpo_step_without_a_reference_is_refused(runs):
  trainer = runs[1]["linen"]
  batch = data.make_dataset(trainer.config, "train", 4).batch(0)
  reference, trainer.frozen_params = trainer.frozen_params, None
  try:
    with pytest.raises(ValueError, match=r"DPO needs a reference model .*call trainer.hold_frozen\(state\)"):
      trainer.train_step(None, batch)  # refused before the state is read
  finally:
    trainer.frozen_params = reference


def test_dpo_learns_the_built_in_preferences():
  # From the seed (no SFT), 80 steps of 8 rows (about 60 pairs each) teach the policy to prefer the
  # right sum over a near miss relative to its reference: measured, train reward accuracy goes from
  # about 0.5 (first 20 steps) to above 0.9 (last 20), and the held-out pairs' loss falls from
  # log 2 = 0.693 (the loss of a policy that still equals its reference) to 0.61.
  config = tiny_config(use_dpo=True, dpo_beta=0.1, learning_rate=1e-3, steps=80)
  trainer = recipe.create_trainer(config)
  dataset = data.make_dataset(config, "train", 8)
  state = trainer.init_state(0)
  trainer.hold_frozen(state)
  accuracy = []
  for step in range(config.steps):
    state, metrics = trainer.train_step(state, dataset.batch(step))
    accuracy.append(float(metrics["reward_accuracy"]))
  held_out = trainer.eval_step(state, data.make_dataset(config, "eval", 8).batch(0))
  assert np.mean(accuracy[:20]) < 0.7 and np.mean(accuracy[-20:]) > 0.85, accuracy
  assert float(held_out["loss"]) < 0.66, f"held-out DPO loss {float(held_out['loss'])} (log 2 = 0.693)"
