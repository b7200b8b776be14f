"""GRPO's variants (GSPO, DAPO, Dr. GRPO, the KL estimators, the aggregation modes, the advantage's std) against
hand computations from the papers' formulas in numpy, by value and by gradient; and the rollout path with several
updates per batch, DAPO and GSPO, identical on Linen and NNX."""

import itertools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxbridge as mb

from maxbridge.core.config import ConfigError
from maxbridge.models import dispatch
from maxbridge.training import recipe, rollouts
from maxbridge.training.loss import Forward
from maxbridge.training.posttrain import grpo
from maxbridge.training.posttrain import grpo_objectives as objectives
from conftest import tiny_config

# --- a fixed batch: 3 groups of 2 completions, uneven lengths, the last group's rewards equal ----------------------

LENGTHS = np.array([3, 5, 2, 4, 5, 1])
MASK = (np.arange(5)[None, :] < LENGTHS[:, None]).astype(np.float64)
REWARDS = np.array([[1.0, 0.0], [0.2, 0.9], [0.5, 0.5]])
# pi / pi_old per token: below 1 - 0.2, inside, between 1 + 0.2 and 1 + 0.28 (clipped only without clip-higher),
# above 1 + 0.28; padding (after each length) holds values that must not count.
RATIOS = np.array(
    [
        [0.5, 1.05, 1.5, 9.0, 9.0],
        [0.7, 0.9, 1.1, 1.25, 1.4],
        [1.3, 0.75, 0.1, 9.0, 9.0],
        [0.95, 1.22, 0.6, 1.35, 9.0],
        [1.0, 1.1, 0.85, 0.7, 1.6],
        [1.45, 9.0, 9.0, 9.0, 9.0],
    ]
)
LOG_PROBS = -np.random.default_rng(0).uniform(0.1, 3.0, RATIOS.shape)
OLD_LOG_PROBS = LOG_PROBS - np.log(RATIOS)
REFERENCE_LOG_PROBS = LOG_PROBS + np.random.default_rng(1).normal(0.0, 0.3, RATIOS.shape)
MAX_LENGTH = 6


def advantages_by_hand(rewards, scale_rewards="group", std="population"):
  """GRPO sec. 4.1.2 (and TRL's batch scaling, Dr. GRPO's none), written out."""
  ddof = {"population": 0, "sample": 1}[std]
  out = np.zeros_like(rewards)
  for i, group in enumerate(rewards):
    centred = group - group.sum() / len(group)
    if scale_rewards == "none":
      out[i] = centred
    else:
      values = group if scale_rewards == "group" else rewards.ravel()
      spread = np.sqrt(np.sum((values - values.mean()) ** 2) / (values.size - ddof))
      out[i] = centred / (spread + 1e-4)
  return out


def objective_by_hand(advantages, *, epsilon, epsilon_high, beta, kl_estimator, level, mode):
  """(loss = sum / count, d loss / d log pi) of GRPO eq. 3 / DAPO eq. 10 / GSPO eqs. 5, 7, 14 with the KL penalty,
  every derivative written out by hand."""
  lp, old, ref, m = LOG_PROBS, OLD_LOG_PROBS, REFERENCE_LOG_PROBS, MASK
  a = advantages[:, None] * np.ones_like(lp)
  n = m.sum(1, keepdims=True)
  if level == "token":
    r = np.exp(lp - old)
  else:  # GSPO eq. 7: s_i = exp(mean over the completion of log pi - log pi_old)
    r = np.exp(np.sum((lp - old) * m, 1, keepdims=True) / n) * np.ones_like(lp)
  low, high = 1 - epsilon, 1 + (epsilon if epsilon_high is None else epsilon_high)
  c = np.clip(r, low, high)
  policy = -np.minimum(r * a, c * a)
  # d policy / d ratio: -A where the unclipped term is the minimum (inside the range both are), else 0.
  d_policy = np.where((r > low) & (r < high) | (r * a < c * a), -a, 0.0)
  x = ref - lp
  kl, d_kl = {
      "k1": (-x, np.ones_like(x)),
      "k2": (0.5 * x**2, -x),
      "k3": (np.exp(x) - x - 1, 1 - np.exp(x)),
  }[kl_estimator]
  weights = {
      "token-mean": m,
      "seq-mean-token-mean": m / n,
      "seq-mean-token-sum": m,
      "seq-mean-token-sum-norm": m / MAX_LENGTH,
  }[mode]
  count = m.sum() if mode == "token-mean" else float(len(m))
  total = np.sum(weights * (policy + beta * kl))
  grad = weights * beta * d_kl
  if level == "sequence":  # s_i moves with every token of its completion: d s_i / d log pi_t = s_i / |o_i|
    grad = grad + np.sum(weights * d_policy, 1, keepdims=True) * r * m / n
  else:  # token ratio, or GSPO-token's sg[s_i] * pi / sg[pi]: d / d log pi_t = the ratio's value, on its own token
    grad = grad + weights * d_policy * r
  means = m if mode == "token-mean" else m / n  # the metrics: per token, or per completion of its token mean
  clip_fraction = np.sum(means * (r != c)) / count
  return total / count, grad / count, {"kl": np.sum(means * kl) / count, "clip_fraction": clip_fraction}


def row_advantages(scale_rewards="group", std="population"):
  return np.asarray(objectives.group_advantages(REWARDS, scale_rewards, std), np.float64).reshape(-1)


@pytest.mark.parametrize("scale_rewards,std", list(itertools.product(objectives.SCALE_REWARDS, objectives.ADVANTAGE_STD)))
def test_advantages_match_the_formula_for_each_scale_and_std(scale_rewards, std):
  rewards = np.array([[1.0, 0.0, 0.5], [2.0, 2.0, 2.0], [0.0, 3.0, 1.0]])
  got = objectives.group_advantages(rewards, scale_rewards, std)
  np.testing.assert_allclose(got, advantages_by_hand(rewards, scale_rewards, std), rtol=1e-6, atol=1e-7)
  np.testing.assert_array_equal(got[1], 0.0)  # all equal: nothing to prefer, whatever the scale


VARIANTS = {
    # name: (keyword arguments of policy_objective, the advantages' scale and std)
    "grpo_today": (
        dict(epsilon=0.2, beta=0.04, kl_estimator="k3", importance_sampling_level="token"),
        "group",
        "population",
    ),
    "grpo_paper_k1": (dict(beta=0.1, kl_estimator="k1", loss_agg_mode="seq-mean-token-mean"), "group", "sample"),
    "k2_token_sum": (dict(beta=0.1, kl_estimator="k2", loss_agg_mode="seq-mean-token-sum"), "batch", "population"),
    "dapo": (dict(epsilon=0.2, epsilon_high=0.28, beta=0.0, loss_agg_mode="token-mean"), "group", "population"),
    "dr_grpo": (dict(beta=0.04, loss_agg_mode="seq-mean-token-sum-norm", max_length=MAX_LENGTH), "none", "population"),
    "gspo": (
        dict(
            epsilon=0.01,
            epsilon_high=0.02,
            beta=0.0,
            importance_sampling_level="sequence",
            loss_agg_mode="seq-mean-token-mean",
        ),
        "group",
        "population",
    ),
    "gspo_token": (
        dict(epsilon=0.01, beta=0.02, importance_sampling_level="sequence_token", loss_agg_mode="seq-mean-token-mean"),
        "group",
        "sample",
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_each_variant_matches_its_papers_formula_by_value_and_gradient(variant):
  options, scale_rewards, std = VARIANTS[variant]
  advantages = row_advantages(scale_rewards, std)
  assert (advantages > 0).any() and (advantages < 0).any() and (advantages[4:] == 0).all()
  batch = {
      "old": jnp.asarray(OLD_LOG_PROBS, jnp.float32),
      "ref": jnp.asarray(REFERENCE_LOG_PROBS, jnp.float32),
      "a": jnp.asarray(advantages[:, None] * np.ones(MASK.shape), jnp.float32),
      "m": jnp.asarray(MASK, jnp.float32),
  }

  def loss(log_probs):
    total, terms = objectives.policy_objective(log_probs, batch["old"], batch["ref"], batch["a"], batch["m"], **options)
    return total / terms["count"], terms

  (value, terms), grad = jax.value_and_grad(loss, has_aux=True)(jnp.asarray(LOG_PROBS, jnp.float32))
  hand = objective_by_hand(
      advantages,
      epsilon=options.get("epsilon", 0.2),
      epsilon_high=options.get("epsilon_high"),
      beta=options.get("beta", 0.04),
      kl_estimator=options.get("kl_estimator", "k3"),
      level=options.get("importance_sampling_level", "token"),
      mode=options.get("loss_agg_mode", "token-mean"),
  )
  np.testing.assert_allclose(value, hand[0], rtol=1e-5, atol=1e-6, err_msg=f"{variant}: loss")
  np.testing.assert_allclose(grad, hand[1], rtol=1e-5, atol=1e-6, err_msg=f"{variant}: d loss / d log pi")
  for key in ("kl", "clip_fraction"):
    np.testing.assert_allclose(
        terms[key] / terms["count"], hand[2][key], rtol=1e-5, atol=1e-6, err_msg=f"{variant}: {key}"
    )
  assert 0 < hand[2]["clip_fraction"] < 1, "the batch must clip some tokens and not others"


def test_clip_higher_keeps_ratios_between_the_two_upper_bounds_unclipped():
  args = [jnp.asarray(x, jnp.float32) for x in (LOG_PROBS, OLD_LOG_PROBS, REFERENCE_LOG_PROBS)]
  a = jnp.ones(MASK.shape, jnp.float32)
  mask = jnp.asarray(MASK, jnp.float32)
  symmetric = objectives.policy_objective(*args, a, mask, epsilon=0.2, beta=0.0)[1]["clip_fraction"]
  higher = objectives.policy_objective(*args, a, mask, epsilon=0.2, epsilon_high=0.28, beta=0.0)[1]["clip_fraction"]
  # 1.25 and 1.22 lie in (1.2, 1.28): clipped by the symmetric range only.
  assert float(symmetric) - float(higher) == 2.0


@pytest.mark.parametrize("mode", objectives.LOSS_AGG_MODES)
def test_micro_batches_add_to_the_full_batch_in_every_aggregation_mode(mode):
  arrays = [jnp.asarray(x, jnp.float32) for x in (LOG_PROBS, OLD_LOG_PROBS, REFERENCE_LOG_PROBS)]
  a = jnp.asarray(row_advantages()[:, None] * np.ones(MASK.shape), jnp.float32)
  mask = jnp.asarray(MASK, jnp.float32)
  options = dict(loss_agg_mode=mode, max_length=MAX_LENGTH)
  total, terms = objectives.policy_objective(*arrays, a, mask, **options)
  halves = [
      objectives.policy_objective(*(x[rows] for x in arrays), a[rows], mask[rows], **options)
      for rows in (slice(0, 2), slice(2, 6))
  ]
  summed = sum(h[0] for h in halves) / sum(h[1]["count"] for h in halves)
  np.testing.assert_allclose(summed, total / terms["count"], rtol=1e-6)


def test_the_grpo_loss_differentiates_to_the_logits_through_the_same_objective():
  # The Loss on a model's logits: d loss / d logits = d loss / d log pi * (onehot - softmax).
  vocab = 7
  logits = jax.random.normal(jax.random.key(2), (*MASK.shape, vocab))
  targets = np.asarray(jax.random.randint(jax.random.key(3), MASK.shape, 0, vocab))
  log_probs = np.asarray(grpo.token_log_probs(logits, jnp.asarray(targets)), np.float64)
  old = log_probs - np.log(RATIOS)
  reference_logits = logits + 0.3 * jax.random.normal(jax.random.key(4), logits.shape)
  advantages = row_advantages()
  batch = {
      "inputs": jnp.zeros(MASK.shape, jnp.int32),
      "inputs_position": jnp.zeros(MASK.shape, jnp.int32),
      "inputs_segmentation": jnp.ones(MASK.shape, jnp.int32),
      "targets": jnp.asarray(targets),
      "targets_segmentation": jnp.asarray(MASK, jnp.int32),
      "advantages": jnp.asarray(advantages[:, None] * np.ones(MASK.shape), jnp.float32),
      "old_log_probs": jnp.asarray(old, jnp.float32),
  }
  forward = lambda params: Forward(lambda p, f, *inputs: (p, {}), params, None)  # noqa: E731
  loss_fn = grpo.GRPO(
      0.05, 0.2, epsilon_high=0.28, kl_estimator="k2", loss_agg_mode="seq-mean-token-mean", old_log_probs=True
  )

  def loss(params):
    total, aux = loss_fn(forward(params), batch, forward(reference_logits))
    return total / aux["tokens"], aux

  (value, aux), grad = jax.value_and_grad(loss, has_aux=True)(logits)
  reference = np.asarray(grpo.token_log_probs(reference_logits, jnp.asarray(targets)), np.float64)
  global LOG_PROBS, OLD_LOG_PROBS, REFERENCE_LOG_PROBS
  saved = LOG_PROBS, OLD_LOG_PROBS, REFERENCE_LOG_PROBS
  LOG_PROBS, OLD_LOG_PROBS, REFERENCE_LOG_PROBS = log_probs, old, reference
  try:
    hand = objective_by_hand(
        advantages,
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.05,
        kl_estimator="k2",
        level="token",
        mode="seq-mean-token-mean",
    )
  finally:
    LOG_PROBS, OLD_LOG_PROBS, REFERENCE_LOG_PROBS = saved
  onehot = np.eye(vocab)[targets]
  want = hand[1][..., None] * (onehot - np.asarray(jax.nn.softmax(logits), np.float64))
  np.testing.assert_allclose(value, hand[0], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-6)
  assert float(aux["tokens"]) == len(MASK)  # per-sequence means count completions


def test_dapo_overlong_shaping_and_informative_groups_follow_eq_13_and_11():
  # max 4 new tokens, a buffer of 2: free up to 2 tokens, then (2 - |y|) / 2, times the factor.
  np.testing.assert_allclose(objectives.overlong_penalty([1, 2, 3, 4, 5], 4, 2, 0.5), [0, 0, -0.25, -0.5, -0.5])
  np.testing.assert_array_equal(objectives.overlong_penalty([1, 4], 4, 0, 1.0), [0, 0])
  np.testing.assert_array_equal(objectives.informative_groups(REWARDS), [True, True, False])


def test_kl_estimators_are_k1_k2_k3():
  lp, ref = jnp.float32(-1.0), jnp.float32(-1.5)
  x = -0.5
  for name, want in {"k1": -x, "k2": 0.5 * x * x, "k3": np.exp(x) - x - 1}.items():
    np.testing.assert_allclose(objectives.kl_estimate(lp, ref, name), want, rtol=1e-6)


def test_bad_variant_values_are_refused_by_name():
  for key, value, error in (
      ("loss_agg_mode", "mean", r"'loss_agg_mode' = 'mean' is invalid; valid values: 'token-mean'"),
      ("grpo_kl_estimator", "k4", r"'grpo_kl_estimator' = 'k4' is invalid; valid values: 'k1', 'k2', 'k3'"),
      ("importance_sampling_level", "seq", r"'importance_sampling_level' = 'seq' is invalid"),
      ("scale_rewards", "yes", r"'scale_rewards' = 'yes' is invalid; valid values: 'group', 'batch', 'none'"),
      ("grpo_advantage_std", "ddof1", r"'grpo_advantage_std' = 'ddof1' is invalid"),
      ("num_iterations", 0, r"'num_iterations' = 0 is invalid; it must be >= 1"),
      ("epsilon_high", -0.5, r"'epsilon_high' = -0.5 is invalid"),
      ("max_num_gen_batches", 0, r"'max_num_gen_batches' = 0 is invalid"),
      ("overlong_buffer_length", 9, r"overlong_buffer_length=9 exceeds the longest completion sampled"),
      ("checkpoint_period", 3, r"num_iterations=2 trains each sampled batch .* checkpoint_period=3 must be a multiple"),
  ):
    with pytest.raises(ConfigError, match=error):
      grpo_config(
          dispatch.BACKENDS["linen"], **{"num_iterations": 2, key: value} if key == "checkpoint_period" else {key: value}
      )


# --- the rollout path: llama-tiny, sampled, scored and trained on both backends ----------------------------------


def digits_reward(prompt, completion):
  """The fraction of digits in the completion: varies between random completions, so advantages are not all 0."""
  return sum(c.isdigit() for c in completion) / max(len(completion), 1)


def grpo_config(flags, **overrides):
  settings = dict(
      use_grpo=True,
      reward_function="test_grpo_variants.digits_reward",
      max_target_length=10,
      max_prefill_predict_length=6,
      per_device_batch_size=2,
      num_generations=4,
      grpo_beta=0.1,
      learning_rate=3e-2,
      warmup_steps_fraction=0.0,
      steps=3,
      checkpoint_period=2,
  )
  return tiny_config(flags, **{**settings, **overrides})


RUNS = {
    # DAPO: clip-higher, dynamic sampling, token-mean, overlong shaping, no KL; two updates per batch.
    "dapo": dict(
        num_iterations=2,
        grpo_epsilon=0.01,
        epsilon_high=0.02,
        grpo_beta=0.0,
        dynamic_sampling=True,
        max_num_gen_batches=3,
        overlong_buffer_length=2,
        overlong_penalty_factor=0.5,
    ),
    # GSPO: the sequence ratio with sequence-mean loss; two updates per batch.
    "gspo": dict(
        num_iterations=2,
        grpo_epsilon=0.003,
        epsilon_high=0.004,
        importance_sampling_level="sequence",
        loss_agg_mode="seq-mean-token-mean",
    ),
}


@pytest.fixture(scope="module")
def variant_runs():
  """Three steps of each run per backend (steps 0 and 1 on one sampled batch, step 2 on the next): (records, the
  trainers, reused below)."""
  records, trainers = {}, {}
  for run in RUNS:
    for name, flags in dispatch.BACKENDS.items():
      trainers[run, name] = recipe.create_trainer(grpo_config(flags, **RUNS[run]))
      records[run, name] = rollouts.train_grpo(grpo_config(flags, **RUNS[run]), trainer=trainers[run, name])[1]
  return records, trainers


@pytest.mark.parametrize("run", list(RUNS))
def test_a_second_update_on_a_batch_sees_a_ratio_and_linen_equals_nnx(variant_runs, run):
  linen, nnx = variant_runs[0][run, "linen"], variant_runs[0][run, "nnx"]
  assert [r["completions"] for r in nnx] == [r["completions"] for r in linen]
  for want, got in zip(linen, nnx, strict=True):
    assert abs(got["loss"] - want["loss"]) <= 1e-6, f"{run} step {want['step']}: loss {got['loss']} != {want['loss']}"
    for key in ("kl", "clip_fraction", "ratio", "mean_reward", "completion_length"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=f"{run} step {want['step']}: {key}")
  first, second, third = linen
  assert first["completions"] == second["completions"] != third["completions"], "num_iterations=2: a batch, 2 steps"
  # The first update: the policy is the sampling one (ratio 1 to float error, nothing clipped); the second: it moved.
  assert abs(first["ratio"] - 1) < 1e-5 and first["clip_fraction"] == 0.0
  assert abs(second["ratio"] - 1) > 1e-4 and second["clip_fraction"] > 0.0, second
  if run == "dapo":
    assert 1 <= first["sampled_batches"] <= 3 and "uninformative_groups" in first


def test_a_dapo_run_resumes_at_a_batch_boundary_as_the_uninterrupted_run(variant_runs, tmp_path):
  # checkpoint_period=2 = num_iterations: the checkpoint after step 1 falls between batches, so the resumed run
  # (here on NNX, from Linen's checkpoint) samples step 2's batch as the uninterrupted in-memory run did.
  records, trainers = variant_runs
  run = dict(base_output_directory=str(tmp_path), run_name="dapo", **RUNS["dapo"])
  first = mb.train(
      grpo_config(dispatch.BACKENDS["linen"], **run), trainer=trainers["dapo", "linen"], until_step=2, progress=False
  )
  resumed = mb.train(grpo_config(dispatch.BACKENDS["nnx"], **run), trainer=trainers["dapo", "nnx"], progress=False)
  logged = [json.loads(line) for line in (tmp_path / "dapo" / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in logged] == [0, 1, 2] and logged == first + resumed
  for want, got in zip(records["dapo", "linen"], logged, strict=True):
    for key in ("loss", "kl", "clip_fraction", "ratio", "mean_reward", "sampled_batches", "uninformative_groups"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=f"step {want['step']}: {key}")


def test_the_batch_a_compile_lowers_has_the_dtypes_rollouts_produce():
  # `maxbridge compile` lowers the step on `Loss.abstract_batch`: int32 advantages would compile another program.
  loss = grpo.GRPO(old_log_probs=True)
  rows = grpo.pack_completions([[1, 2]], [[3], [4, 5]], np.array([0.5, -0.5]), 8)
  rows["old_log_probs"] = np.zeros((2, 8), np.float32)  # as Rollouts records them
  declared = {key: (value.shape, np.dtype(value.dtype)) for key, value in loss.abstract_batch(2, 8).items()}
  assert declared == {key: (rows[key].shape, rows[key].dtype) for key in loss.batch_keys}
