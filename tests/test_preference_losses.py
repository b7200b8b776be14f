"""ORPO, SimPO and KTO (and DPO on the same shared module): each loss's pure function against a numpy hand
computation of its paper's formula, by value and by gradient with respect to the logits; three short runs per
loss with Linen equal to NNX; KTO's unpaired rows; bad rows and configs refused by name."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxbridge.core.config import ConfigError
from maxbridge.training import data, recipe
from maxbridge.training.posttrain import kto, preference
from conftest import tiny_config

NNX = (True, True, True)
LINEN = (False, False, False)

# --- a fixed batch: two sides of 2 rows of 7 tokens over a vocabulary of 5 ------------------------------------------
# Three pairs ((row 0, segment 1), (row 0, segment 2), (row 1, segment 1)) of uneven completion lengths on each
# side, padding after them; (row 1, segment 2) holds a completion on the first side only, so no pair: masked.
FIRST = np.array([[1, 1, 0, 2, 2, 2, 0], [0, 1, 1, 1, 1, 2, 0]], np.int32)
SECOND = np.array([[1, 0, 2, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0]], np.int32)
SEGMENTS = np.concatenate([FIRST, SECOND])
TARGETS = np.random.default_rng(0).integers(0, 5, SEGMENTS.shape).astype(np.int32)
LOGITS = np.random.default_rng(1).normal(size=(*SEGMENTS.shape, 5)).astype(np.float32)
# The reference's summed log-probabilities per (row, segment) of each side, given as numbers.
REF = np.random.default_rng(2).uniform(-9, -1, (4, 8)).astype(np.float32)


def np_segment_log_probs(logits):
  """(sums, counts) per (row, segment) in float64, token by token."""
  logits = np.asarray(logits, np.float64)
  log_softmax = logits - logits.max(-1, keepdims=True)
  log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
  sums, counts = np.zeros((4, 8)), np.zeros((4, 8))
  for r in range(4):
    for t in range(7):
      if SEGMENTS[r, t]:
        sums[r, SEGMENTS[r, t]] += log_softmax[r, t, TARGETS[r, t]]
        counts[r, SEGMENTS[r, t]] += 1
  return sums, counts


log_sigmoid = lambda x: -np.logaddexp(0, -x)  # noqa: E731
sigmoid = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731


def hand(name, sums, counts, z_ref=None):
  """Each paper's per-pair (or per-example) loss in float64 numpy, summed over the pairs (both sides' tokens)."""
  w, l, nw, nl = sums[:2], sums[2:], counts[:2], counts[2:]
  pairs = (nw > 0) & (nl > 0)
  if name == "dpo":  # Rafailov et al. 2023, eq. 7, label smoothing 0.2
    z = 0.5 * ((w - REF[:2]) - (l - REF[2:]))
    losses = -0.8 * log_sigmoid(z) - 0.2 * log_sigmoid(-z)
  elif name == "orpo":  # Hong et al. 2024, eq. 6-7, per-token mean log-probabilities
    mw, ml = w / np.maximum(nw, 1), l / np.maximum(nl, 1)
    odds = lambda m: m - np.log1p(-np.exp(np.minimum(m, -1e-7)))  # noqa: E731
    losses = -mw - 0.3 * log_sigmoid(odds(mw) - odds(ml))
  elif name == "simpo":  # Meng et al. 2024, eq. 6, label smoothing 0.1
    z = 2.0 * w / np.maximum(nw, 1) - 2.0 * l / np.maximum(nl, 1) - 0.5
    losses = -0.9 * log_sigmoid(z) - 0.1 * log_sigmoid(-z)
  else:  # KTO, Ethayarajh et al. 2024, eq. 8: side 1 the examples, side 2 their mismatched pairs
    present = nw > 0
    if z_ref is None:
      z_ref = max(0.0, ((l - REF[2:])[nl > 0]).mean())
    r = w - REF[:2]
    desirable = KTO_DESIRABLE
    losses = np.where(desirable, 1.5 * (1 - sigmoid(0.1 * (r - z_ref))), 0.7 * (1 - sigmoid(0.1 * (z_ref - r))))
    return (losses * present).sum(), z_ref
  return (losses * pairs).sum(), None


KTO_DESIRABLE = np.zeros((2, 8), bool)
KTO_DESIRABLE[0, 1] = KTO_DESIRABLE[1, 2] = True


def ours(name, logits):
  """The same sum through `segment_log_probs` and the loss's pure function, in float32 JAX."""
  sums, counts = preference.segment_log_probs(logits, jnp.asarray(TARGETS), jnp.asarray(SEGMENTS))
  w, l, nw, nl = sums[:2], sums[2:], counts[:2], counts[2:]
  ref = jnp.asarray(REF)
  if name == "dpo":
    losses, _, _ = preference.dpo_loss(w, l, ref[:2], ref[2:], 0.5, 0.2)
  elif name == "orpo":
    losses = preference.orpo_loss(w, nw, l, nl, 0.3)[0]
  elif name == "simpo":
    losses = preference.simpo_loss(w, nw, l, nl, 2.0, 0.5, 0.1)[0]
  else:
    kl_present = (nl > 0).astype(jnp.float32)
    losses, _, _ = preference.kto_loss(w, ref[:2], l, ref[2:], jnp.asarray(KTO_DESIRABLE), kl_present, 0.1, 1.5, 0.7)
    return jnp.sum(losses * (nw > 0))
  return jnp.sum(losses * preference.pair_mask(nw, nl))


@pytest.mark.parametrize("name", ["dpo", "orpo", "simpo", "kto"])
def test_each_loss_equals_its_papers_formula_by_value_and_by_gradient_through_the_logits(name):
  sums, counts = np_segment_log_probs(LOGITS)
  want, z_ref = hand(name, sums, counts)
  np.testing.assert_allclose(float(ours(name, jnp.asarray(LOGITS))), want, rtol=1e-6, atol=1e-6)
  # Central differences of the float64 hand computation (KTO's z_ref held, as it carries no gradient).
  grad = np.asarray(jax.grad(lambda x: ours(name, x))(jnp.asarray(LOGITS)))
  numeric, eps = np.zeros(LOGITS.shape), 1e-6
  for index in np.ndindex(LOGITS.shape):
    up, down = LOGITS.astype(np.float64), LOGITS.astype(np.float64)
    up[index] += eps
    down[index] -= eps
    numeric[index] = (
        hand(name, *np_segment_log_probs(up), z_ref)[0] - hand(name, *np_segment_log_probs(down), z_ref)[0]
    ) / (2 * eps)
  assert np.abs(numeric).max() > 1e-3, "the batch should carry a gradient"
  np.testing.assert_allclose(grad, numeric, atol=1e-6)
  if name == "kto":  # the mismatched pairs only set z_ref: no gradient through them
    assert not grad[2:].any()


def test_the_losses_on_given_log_probabilities():
  """Hand-picked numbers where each formula's terms are easy to read off."""
  chosen, rejected = jnp.array([-2.0, -6.0]), jnp.array([-4.0, -3.0])
  counts_w, counts_l = jnp.array([2.0, 3.0]), jnp.array([4.0, 1.0])
  # SimPO: means (-1, -2) vs (-1, -3): margins 2 * (0, 1) - 0.5.
  losses, cw, cl = preference.simpo_loss(chosen, counts_w, rejected, counts_l, 2.0, 0.5)
  np.testing.assert_allclose(losses, -log_sigmoid(np.array([-0.5, 1.5])), rtol=1e-6)
  np.testing.assert_allclose(cw - cl, [0.0, 2.0], atol=1e-6)
  # ORPO: mean log-probabilities -1 and -1 (pair 0): equal odds, the term log 2 times lambda, plus the NLL 1.
  losses, log_sigmoid_ratio, ratio, nll = preference.orpo_loss(chosen, counts_w, rejected, counts_l, 0.1)
  odds = lambda m: np.log(np.exp(m) / (1 - np.exp(m)))  # noqa: E731
  np.testing.assert_allclose(ratio, [0.0, odds(-2.0) - odds(-3.0)], atol=1e-6)
  np.testing.assert_allclose(losses[0], 1 + 0.1 * np.log(2), rtol=1e-6)
  np.testing.assert_allclose(nll, [1.0, 2.0], rtol=1e-6)
  # KTO: KL estimates 0.5 and -1.5 average to -0.5, so z_ref is 0 (clamped); rewards r = (1, -2).
  losses, rewards, z_ref = preference.kto_loss(
      jnp.array([-1.0, -5.0]),
      jnp.array([-2.0, -3.0]),
      jnp.array([-1.5, -4.5]),
      jnp.array([-2.0, -3.0]),
      jnp.array([1.0, 0.0]),
      jnp.array([1.0, 1.0]),
      1.0,
      1.0,
      2.0,
  )
  assert float(z_ref) == 0.0
  np.testing.assert_allclose(losses, [1 - sigmoid(1.0), 2 * (1 - sigmoid(2.0))], rtol=1e-6)
  np.testing.assert_allclose(rewards, [1.0, -2.0], rtol=1e-6)


def test_kto_rows_pack_each_completion_beside_its_mismatched_pair():
  rows = [([1, 2], [3], True), ([4], [5, 6], False), ([7, 7], [8], True)]
  items = kto.examples(rows)
  packed = kto.pack(items, 8)
  # Example i's mismatched pair is its prompt with row i - 1's completion (the last row's for the first).
  np.testing.assert_array_equal(packed["completion_inputs"], [[1, 2, 3, 4, 5, 6, 0, 0], [7, 7, 8, 0, 0, 0, 0, 0]])
  np.testing.assert_array_equal(packed["kl_inputs"], [[1, 2, 8, 4, 3, 0, 0, 0], [7, 7, 5, 6, 0, 0, 0, 0]])
  np.testing.assert_array_equal(packed["completion_targets_segmentation"], [[0, 1, 0, 2, 2, 0, 0, 0], [0, 1] + [0] * 6])
  np.testing.assert_array_equal(packed["desirable_segmentation"], [[0, 1, 0, 0, 0, 0, 0, 0], [0, 1] + [0] * 6])
  builtin = kto.builtin_rows()
  assert len(builtin) == 2 * 400 and sum(r[2] for r in builtin) == 400
  assert all(a[0] != b[0] for a, b in zip(builtin, builtin[1:])), "consecutive rows share a prompt"
  batch = data.make_dataset(tiny_config(use_kto=True), "train", 4).batch(0)
  assert set(batch) == set(kto.KTO.batch_keys)
  assert 0 < (batch["desirable_segmentation"] > 0).sum() < (batch["completion_targets_segmentation"] > 0).sum()


def test_kto_through_grain_pairs_each_example_with_the_previous_one_in_the_stream_and_resumes_exactly(tmp_path):
  from maxbridge.training import grain_data

  rows = [{"prompt": f"{a}+1=", "completion": f"{a + 1}\n", "label": a % 3 != 0} for a in range(12)]
  path = tmp_path / "kto.jsonl"
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  config = tiny_config(use_kto=True, dataset_type="grain", grain_train_files=str(path), max_target_length=16)
  dataset = grain_data.GrainDataset(config, "train", 2, shuffle=False, num_epochs=1)
  try:
    first = dataset.batch(0)
    state = dataset.get_state()
    second = dataset.batch(1)
  finally:
    dataset.close()
  assert set(first) == set(kto.KTO.batch_keys)
  # Row 0 of the stream (the first training row in file order: every 20th is held out, row 0) packs examples
  # 1 and 2; example 1 is the stream's first (no mismatched pair), example 2's pair is its prompt with 1's answer.
  decode = lambda tokens: bytes(int(t) for t in tokens if t).decode()  # noqa: E731
  assert decode(first["completion_inputs"][0]) == "1+1=2\n2+1=3\n"
  assert decode(first["kl_inputs"][0]) == "1+1=2+1=2\n"
  assert (first["kl_targets_segmentation"][0] == 1).sum() == 0 and (first["kl_targets_segmentation"][0] == 2).sum()
  # Examples 1 and 2 are desirable (1 % 3, 2 % 3 != 0): both segments marked.
  assert set(first["desirable_segmentation"][0][first["desirable_segmentation"][0] > 0]) == {1, 2}
  resumed = grain_data.GrainDataset(config, "train", 2, shuffle=False, num_epochs=1)
  try:
    resumed.set_state(state)
    again = resumed.batch(1)
  finally:
    resumed.close()
  for key in second:
    np.testing.assert_array_equal(again[key], second[key], err_msg=key)


# --- short runs: Linen and NNX, three losses --------------------------------------------------------------------------

RUNS = {
    "orpo": dict(use_orpo=True, orpo_lambda=0.5),
    "simpo": dict(use_simpo=True, simpo_beta=2.0, simpo_gamma=0.5),
    "kto": dict(use_kto=True, kto_beta=0.5, kto_desirable_weight=1.0, kto_undesirable_weight=1.5),
}
STEPS = 4


@pytest.fixture(scope="module")
def runs():
  """Per loss and backend, the metrics of STEPS steps on one fixed batch (one trainer each)."""
  out = {}
  for name, keys in RUNS.items():
    for backend, flags in (("linen", LINEN), ("nnx", NNX)):
      config = tiny_config(flags, per_device_batch_size=4, learning_rate=3e-3, warmup_steps_fraction=0.0, **keys)
      trainer = recipe.create_trainer(config)
      batch = data.make_dataset(config, "train", 4).batch(0)
      state = trainer.init_state(0)
      trainer.hold_frozen(state)
      metrics = []
      for _ in range(STEPS):
        state, step = trainer.train_step(state, batch)
        metrics.append({key: float(value) for key, value in step.items() if np.ndim(value) == 0})
      out[name, backend] = metrics
  return out


@pytest.mark.parametrize("name", list(RUNS))
def test_short_runs_are_equal_on_linen_and_nnx_and_move_their_metrics(runs, name):
  linen, nnx = runs[name, "linen"], runs[name, "nnx"]
  keys = {"loss", "grad_norm", *recipe.create_loss(tiny_config(**RUNS[name])).metric_keys}
  for step, (want, got) in enumerate(zip(linen, nnx, strict=True)):
    assert keys <= set(want)
    for key in keys:
      np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-6, err_msg=f"step {step}: {key}")
  losses = [m["loss"] for m in linen]
  assert all(b < a for a, b in zip(losses, losses[1:])), losses
  if name == "orpo":  # the chosen side's likelihood and its odds over the rejected side's both rise
    assert linen[-1]["nll_loss"] < linen[0]["nll_loss"]
    assert linen[-1]["log_odds_chosen"] > linen[0]["log_odds_chosen"]
  elif name == "simpo":
    assert linen[-1]["margins"] > linen[0]["margins"]
  else:  # the policy starts as its reference: every reward and z_ref 0, each loss half its weight
    assert linen[0]["desirable_rewards"] == 0 and linen[0]["kl"] == 0
    fraction = linen[0]["desirable_fraction"]
    np.testing.assert_allclose(linen[0]["loss"], 0.5 * fraction + 0.75 * (1 - fraction), rtol=1e-6)
    assert linen[-1]["desirable_rewards"] > 0 and linen[-1]["undesirable_rewards"] < 0


# --- refusals -------------------------------------------------------------------------------------------------------


def test_bad_rows_and_configs_are_refused_by_name(tmp_path):
  path = tmp_path / "kto.jsonl"
  path.write_text(
      json.dumps({"prompt": "1+1=", "completion": "2\n", "label": True})
      + "\n"
      + json.dumps({"prompt": "1+2=", "completion": "4\n", "label": "no"})
      + "\n"
  )
  config = tiny_config(use_kto=True, dataset_type="sft", dataset_path=str(path))
  with pytest.raises(ValueError, match=r'kto.jsonl:2: a KTO row needs a boolean "label" .*got \'no\''):
    data.make_dataset(config, "train", 4)
  with pytest.raises(ConfigError, match="use_dpo=true and use_orpo=true: a run trains one objective"):
    tiny_config(use_dpo=True, use_orpo=True)
  with pytest.raises(ConfigError, match="use_grpo=true and use_simpo=true: a run trains one objective"):
    tiny_config(use_simpo=True, use_grpo=True)
  with pytest.raises(ConfigError, match="use_kto=true reads unpaired rows: dataset_type must be 'sft'"):
    tiny_config(use_kto=True, dataset_type="synthetic")
  with pytest.raises(ConfigError, match=r"'simpo_beta' = 0.0 is invalid; it must be > 0"):
    tiny_config(use_simpo=True, simpo_beta=0.0)
