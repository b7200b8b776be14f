"""GRPO's pieces: verifiable rewards, group-normalised advantages, batches and the loss.

For each prompt, `num_generations` completions are sampled; each is scored by
a reward function, and its advantage is its reward normalised within its
group (the prompt's completions): (r - mean) / (std + eps). The loss, over
completion tokens, is the clipped policy ratio of PPO plus a KL penalty to the
frozen reference (Shao et al. 2024, MaxText's `grpo_epsilon`, `grpo_beta`):

    ratio = exp(log pi - log pi_old)
    loss  = -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon) * A)
            + beta * (exp(log ref - log pi) - (log ref - log pi) - 1)

summed over completion tokens and divided by their count (token-level, so
gradient accumulation stays exact). With one update per sampled batch (as
here), pi_old is the policy itself with no gradient: the ratio is 1 in value
and its gradient is the policy gradient, so with beta = 0 the loss reduces to
-A * log pi up to a constant.

Not yet here: the sampling loop that feeds these batches from the engine.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.loss import Batch, CrossEntropy, Forward, Loss
from maxbridge.posttrain import sft

ADVANTAGE_EPS = 1e-4
_ANSWER = re.compile(r"-?\d+\n")


def exact_match_reward(prompt: str, completion: str) -> float:
  """1.0 when the completion's first line is the sum the `a+b=` prompt asks for, else 0.0."""
  a, b = prompt.rstrip("=").split("+")
  return float(completion.split("\n", 1)[0] == str(int(a) + int(b)))


def format_reward(prompt: str, completion: str) -> float:
  """1.0 when the completion is one integer and a newline (the built-in set's answer format)."""
  return float(_ANSWER.fullmatch(completion) is not None)


def builtin_reward(prompt: str, completion: str) -> float:
  return exact_match_reward(prompt, completion) + 0.1 * format_reward(prompt, completion)


def group_advantages(rewards: np.ndarray) -> np.ndarray:
  """[prompts, num_generations] rewards -> advantages, zero-mean and unit-scale within each group.

  A group whose rewards are all equal gets zeros: nothing in it to prefer.
  """
  rewards = np.asarray(rewards, np.float64)
  if rewards.ndim != 2 or rewards.shape[1] < 2:
    raise ValueError(f"rewards must be [prompts, num_generations] with num_generations >= 2, got shape {rewards.shape}")
  centred = rewards - rewards.mean(axis=1, keepdims=True)
  return (centred / (rewards.std(axis=1, keepdims=True) + ADVANTAGE_EPS)).astype(np.float32)


def pack_completions(prompts: list[list[int]], completions: list[list[int]], advantages: np.ndarray, length: int) -> dict:
  """One (prompt + completion) per row, completion tokens as targets, and `advantages` [rows, length]
  (each row's advantage on every position); `completions` is prompt-major, `num_generations` per prompt."""
  groups = len(completions) // len(prompts)
  examples = [sft.example(prompts[i // groups], completion) for i, completion in enumerate(completions)]
  rows = sft.fill_rows([[i] for i in range(len(examples))], [(t[:length], c[:length]) for t, c in examples], length, True)
  rows["advantages"] = np.broadcast_to(np.asarray(advantages, np.float32).reshape(-1, 1), (len(examples), length)).copy()
  return rows


class GRPO(Loss):
  """The clipped-ratio loss with a KL penalty to the frozen reference; metrics per completion token."""

  batch_keys = (*CrossEntropy.batch_keys, "advantages")
  needs_reference = True
  frozen_reference = True
  metric_keys = ("kl", "clip_fraction")

  def __init__(self, beta: float = 0.04, epsilon: float = 0.2):
    self.beta = beta
    self.epsilon = epsilon

  def __call__(self, forward: Forward, batch: Batch, reference: Forward | None = None) -> tuple[jax.Array, dict]:
    if reference is None:
      raise ValueError("GRPO needs a reference model for its KL penalty (Trainer.set_reference)")
    inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    logits, intermediates = forward(*inputs)
    log_probs = token_log_probs(logits, batch["targets"])
    reference_log_probs = jax.lax.stop_gradient(token_log_probs(reference(*inputs)[0], batch["targets"]))
    mask = (batch["targets_segmentation"] > 0).astype(jnp.float32)
    ratio = jnp.exp(log_probs - jax.lax.stop_gradient(log_probs))
    advantages = batch["advantages"]
    clipped = jnp.clip(ratio, 1 - self.epsilon, 1 + self.epsilon)
    policy = -jnp.minimum(ratio * advantages, clipped * advantages)
    delta = reference_log_probs - log_probs
    kl = jnp.exp(delta) - delta - 1
    loss, aux = CrossEntropy.total(jnp.sum((policy + self.beta * kl) * mask), jnp.float32(0.0), mask, intermediates)
    del aux["z_loss"]
    aux["kl"] = jnp.sum(kl * mask)
    aux["clip_fraction"] = jnp.sum((ratio != clipped) * mask)
    return loss, aux


def token_log_probs(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """log p(target) at every position, float32 [B, T]."""
  return jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), targets[..., None], -1)[..., 0]
