"""GRPO's pieces: verifiable rewards, group-normalised advantages, and the loss (its gradient by
hand, and Linen == NNX through the one train step)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxbridge import dispatch
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


def test_grpo_trains_equally_on_linen_and_nnx():
  prompts = [list(b"3+4="), list(b"10+2=")]
  completions = [list(b"7\n"), list(b"8\n"), list(b"12\n"), list(b"1\n")]
  rewards = np.array(
      [
          [grpo.builtin_reward(bytes(p).decode(), bytes(c).decode()) for c in completions[2 * i : 2 * i + 2]]
          for i, p in enumerate(prompts)
      ]
  )
  batch = grpo.pack_completions(prompts, completions, grpo.group_advantages(rewards), 16)
  out = {}
  for name, flags in {"linen": (False, False, False), "nnx": (True, True, True)}.items():
    config = tiny_config(flags, max_target_length=16, warmup_steps_fraction=0.0, learning_rate=1e-2)
    trainer = dispatch.create_trainer(config, loss=grpo.GRPO(beta=0.1, epsilon=0.2))
    state = trainer.init_state(0)
    trainer.set_reference(state)
    out[name] = []
    for _ in range(2):
      state, metrics = trainer.train_step(state, batch)
      out[name].append({key: float(metrics[key]) for key in ("loss", "kl", "clip_fraction", "grad_norm")})
  assert out["linen"][0]["kl"] == 0.0 and out["linen"][1]["kl"] > 0.0  # the policy left the reference
  for want, got in zip(out["linen"], out["nnx"]):
    for key in want:
      np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-7, err_msg=key)
