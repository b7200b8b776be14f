"""GRPO: verifiable rewards, group-normalised advantages, the loss (its gradient by hand), and the
sample-score-update loop, identical on Linen and NNX."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxbridge.loss import Forward
from maxbridge.posttrain import grpo
from conftest import tiny_config


def test_the_built_in_rewards_score_answer_and_format():
  assert grpo.exact_match_reward("12+7=", "19\n") == 1.0
  assert grpo.exact_match_reward("12+7=", "18\n") == 0.0
  assert grpo.exact_match_reward("12+7=", "19 and more") == 0.0
  assert grpo.format_reward("12+7=", "18\n") == 1.0 and grpo.format_reward("12+7=", "18\n\n") == 0.0
  assert grpo.builtin_reward("1+1=", "2\n") == pytest.approx(1.1)


def test_advantages_are_zero_mean_and_unit_scale_within_each_group():
  rewards = np.array([[1.0, 0.0, 0.0, 1.0], [0.1, 1.1, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
  advantages = grpo.group_advantages(rewards)
  np.testing.assert_allclose(advantages.mean(axis=1), 0.0, atol=1e-6)
  np.testing.assert_allclose(advantages[:2].std(axis=1), 1.0, rtol=1e-3)  # up to ADVANTAGE_EPS
  np.testing.assert_array_equal(advantages[2], 0.0)  # all equal: nothing to prefer
  np.testing.assert_allclose(advantages[0], [1, -1, -1, 1], rtol=1e-3)
  with pytest.raises(ValueError, match="num_generations >= 2"):
    grpo.group_advantages(np.ones((3, 1)))


def test_with_beta_zero_one_update_is_the_policy_gradient():
  # One prompt, two completions: reward 1 and 0, so advantages +1 and -1.
  rows = grpo.pack_completions([[1, 2]], [[3, 4], [5]], grpo.group_advantages([[1.0, 0.0]]), 6)
  np.testing.assert_array_equal(rows["inputs"], [[1, 2, 3, 4, 0, 0], [1, 2, 5, 0, 0, 0]])
  np.testing.assert_array_equal(rows["targets_segmentation"], [[0, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0]])
  logits = jax.random.normal(jax.random.key(0), (2, 6, 8))
  batch = {key: jnp.asarray(value) for key, value in rows.items()}
  # Fixed logits stand in for a model: the gradient below is with respect to them.
  forward = lambda params: Forward(lambda p, f, *inputs: (p, {}), params, None)  # noqa: E731

  def loss(params):
    total, aux = grpo.GRPO(beta=0.0)(forward(params), batch, forward(logits))
    return total / aux["tokens"], aux

  (value, aux), grad = jax.value_and_grad(loss, has_aux=True)(logits)
  # d/dlogits of -A * log softmax(logits)[target] / tokens = -A * (onehot - softmax) / tokens.
  advantages = np.asarray(rows["advantages"])[..., None]
  onehot = np.eye(8)[rows["targets"]]
  mask = (rows["targets_segmentation"] > 0)[..., None]
  want = -advantages * (onehot - np.asarray(jax.nn.softmax(logits))) * mask / mask.sum()
  np.testing.assert_allclose(grad, want, atol=1e-6)
  # The value: the ratio is 1, so the loss is -mean(A) over completion tokens; the reference is the
  # policy itself here, so the KL is 0 and nothing is clipped.
  np.testing.assert_allclose(value, -(1 * 2 - 1 * 1) / 3 * float(advantages[0, 0, 0]), rtol=1e-3)
  assert float(aux["kl"]) == 0.0 and float(aux["clip_fraction"]) == 0.0


@pytest.fixture(scope="module")
def grpo_runs():
  """Three GRPO steps (sampling, scoring, update) from seed 0 per backend."""
  out = {}
  for name, flags in {"linen": (False, False, False), "nnx": (True, True, True)}.items():
    config = tiny_config(flags, max_target_length=16, warmup_steps_fraction=0.0, learning_rate=1e-2)
    out[name] = grpo.train_grpo(config, steps=3, num_generations=4, prompts_per_step=2, grpo_beta=0.1)[1]
  return out


def test_grpo_samples_scores_and_trains_identically_on_linen_and_nnx(grpo_runs):
  linen, nnx = grpo_runs["linen"], grpo_runs["nnx"]
  assert [r["completions"] for r in nnx] == [r["completions"] for r in linen]
  assert len(linen[0]["completions"]) == 8 and linen[0]["completions"] != linen[1]["completions"]
  for want, got in zip(linen, nnx):
    for key in ("loss", "kl", "clip_fraction", "mean_reward", "completion_length"):
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=f"step {want['step']}: {key}")
  assert linen[0]["kl"] == 0.0 and linen[-1]["kl"] > 0.0


def test_grpo_refuses_bad_rewards_and_a_single_generation():
  config = tiny_config()
  with pytest.raises(ValueError, match="num_generations=1 must be >= 2"):
    grpo.train_grpo(config, steps=1, num_generations=1)
  with pytest.raises(ValueError, match=r"reward 'no_such_module.reward' cannot be imported"):
    grpo.load_reward("no_such_module.reward")
  with pytest.raises(ValueError, match=r"reward 'pair' must return one number per completion, got \(1, 2\)"):
    grpo.score(pair, ["1+1="], ["2\n", "3\n"], 2)
  assert grpo.load_reward("maxbridge.posttrain.grpo.exact_match_reward") is grpo.exact_match_reward


def pair(prompt, completion):
  return (1, 2)
