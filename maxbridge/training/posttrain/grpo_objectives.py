"""GRPO's variants as pure functions of arrays: advantages, importance ratios, clipping, KL estimators, aggregation,
DAPO's overlong shaping and its informative groups. `grpo.GRPO` and `grpo.Rollouts` call them; a test calls them
with no model.

The papers: GRPO (Shao et al. 2024, DeepSeekMath, eq. 3), DAPO (Yu et al. 2025, eqs. 8-13), Dr. GRPO (Liu et al.
2025, "Understanding R1-Zero-Like Training", sec. 3.1: its objective drops both 1/|o_i| and 1/std), GSPO (Zheng et
al. 2025, eqs. 5-7 and 13-14); the KL estimators are Schulman's ("Approximating KL Divergence", 2020: k1, k2, k3).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.core import posttrain_rules

ADVANTAGE_EPS = 1e-4

# Named as TRL's GRPOConfig (scale_rewards, importance_sampling_level) and verl's / Tunix's loss_agg_mode; the
# config checks its keys against these without JAX, so they live there.
SCALE_REWARDS = posttrain_rules.GRPO_SCALE_REWARDS
ADVANTAGE_STD = posttrain_rules.GRPO_ADVANTAGE_STD
KL_ESTIMATORS = posttrain_rules.GRPO_KL_ESTIMATORS
IMPORTANCE_SAMPLING_LEVELS = posttrain_rules.GRPO_IMPORTANCE_SAMPLING_LEVELS
LOSS_AGG_MODES = posttrain_rules.GRPO_LOSS_AGG_MODES


def group_advantages(rewards: np.ndarray, scale_rewards: str = "group", std: str = "population") -> np.ndarray:
  """[prompts, num_generations] rewards -> advantages: each reward less its group's mean, over a standard deviation.

  GRPO (DeepSeekMath sec. 4.1.2): (r - mean(r_group)) / std(r_group); `scale_rewards` "batch" divides by the std
  of all the step's rewards instead (TRL's), "none" by nothing (Dr. GRPO sec. 3.1: no std normalisation). `std` is
  the population's (ddof 0, today's) or the sample's (ddof 1, as torch's default std in TRL). A group whose rewards
  are all equal gets zeros: nothing in it to prefer.
  """
  rewards = np.asarray(rewards, np.float64)
  if rewards.ndim != 2 or rewards.shape[1] < 2:
    raise ValueError(f"rewards must be [prompts, num_generations] with num_generations >= 2, got shape {rewards.shape}")
  if scale_rewards not in SCALE_REWARDS or std not in ADVANTAGE_STD:
    raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS} and std one of {ADVANTAGE_STD}")
  centred = rewards - rewards.mean(axis=1, keepdims=True)
  ddof = 1 if std == "sample" else 0
  if scale_rewards == "none":
    return centred.astype(np.float32)
  scale = rewards.std(axis=1, ddof=ddof, keepdims=True) if scale_rewards == "group" else rewards.std(ddof=ddof)
  return (centred / (scale + ADVANTAGE_EPS)).astype(np.float32)


def overlong_penalty(lengths: np.ndarray, max_length: int, buffer_length: int, factor: float) -> np.ndarray:
  """DAPO eq. 13, soft overlong punishment, per completion of `lengths` tokens: 0 up to max_length - buffer_length,
  then falling linearly to -factor at max_length (-factor past it); buffer_length 0 gives zeros."""
  lengths = np.asarray(lengths, np.float64)
  if buffer_length <= 0:
    return np.zeros_like(lengths)
  free = max_length - buffer_length
  shaped = np.where(lengths <= free, 0.0, (free - lengths) / buffer_length)
  return factor * np.where(lengths > max_length, -1.0, shaped)


def informative_groups(rewards: np.ndarray) -> np.ndarray:
  """[prompts] bools: DAPO eq. 11's constraint 0 < |{correct}| < G, for any reward: not all of a group's equal."""
  rewards = np.asarray(rewards)
  return np.any(rewards != rewards[:, :1], axis=1)


def importance_ratio(log_probs: jax.Array, old_log_probs: jax.Array, mask: jax.Array, level: str) -> jax.Array:
  """[B, T] ratio of the policy to the one that sampled, per `level`.

  "token": pi / pi_old per token (GRPO eq. 3, DAPO eq. 8). "sequence": GSPO eq. 7, s_i = exp(mean over the
  completion of log pi - log pi_old), the same on each of its tokens, its gradient through the mean. "sequence_token":
  GSPO-token eq. 14, s_i,t = sg[s_i] * pi / sg[pi] (Tunix's loss_algo gspo-token): s_i in value, each token's own
  gradient.
  """
  log_ratio = log_probs - old_log_probs
  if level == "token":
    return jnp.exp(log_ratio)
  lengths = jnp.maximum(jnp.sum(mask, axis=-1, keepdims=True), 1.0)
  sequence = jnp.sum(log_ratio * mask, axis=-1, keepdims=True) / lengths
  if level == "sequence":
    return jnp.broadcast_to(jnp.exp(sequence), log_probs.shape)
  if level == "sequence_token":
    return jnp.exp(jax.lax.stop_gradient(sequence) + log_probs - jax.lax.stop_gradient(log_probs))
  raise ValueError(f"importance_sampling_level must be one of {IMPORTANCE_SAMPLING_LEVELS}, got {level!r}")


def kl_estimate(log_probs: jax.Array, reference_log_probs: jax.Array, estimator: str) -> jax.Array:
  """Per-token estimate of KL(pi || pi_ref) from samples of pi, with log_ratio = log pi_ref - log pi: k1 = -log_ratio,
  k2 = log_ratio^2 / 2, k3 = exp(log_ratio) - log_ratio - 1 (GRPO eq. 4, the paper's; unbiased and >= 0)."""
  log_ratio = reference_log_probs - log_probs
  if estimator == "k1":
    return -log_ratio
  if estimator == "k2":
    return 0.5 * jnp.square(log_ratio)
  if estimator == "k3":
    return jnp.exp(log_ratio) - log_ratio - 1
  raise ValueError(f"grpo_kl_estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")


def aggregate(per_token: jax.Array, mask: jax.Array, mode: str, max_length: int = 1) -> tuple[jax.Array, jax.Array]:
  """(sum, count) of per-token values [B, T] over `mask`, so that sum / count is the loss `mode` asks for, and
  micro-batches' sums and counts add to the batch's (gradient accumulation stays exact):

  - "token-mean": every completion token of the batch weighs the same (DAPO eq. 12); count: tokens.
  - "seq-mean-token-mean": each completion's token mean, averaged over completions (GRPO eq. 3); count: completions.
  - "seq-mean-token-sum": each completion's token sum, averaged over completions; count: completions.
  - "seq-mean-token-sum-norm": token sums over the constant `max_length` (the longest completion sampled), averaged
    over completions (Dr. GRPO sec. 3.1: no length normalisation; its code divides by MAX_TOKENS); count: completions.
  """
  summed = jnp.sum(per_token * mask, axis=-1)
  lengths = jnp.sum(mask, axis=-1)
  if mode == "token-mean":
    return jnp.sum(summed), jnp.sum(lengths)
  sequences = jnp.sum((lengths > 0).astype(jnp.float32))
  if mode == "seq-mean-token-mean":
    return jnp.sum(summed / jnp.maximum(lengths, 1.0)), sequences
  if mode == "seq-mean-token-sum":
    return jnp.sum(summed), sequences
  if mode == "seq-mean-token-sum-norm":
    return jnp.sum(summed) / max_length, sequences
  raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {mode!r}")


def policy_objective(
    log_probs: jax.Array,
    old_log_probs: jax.Array,
    reference_log_probs: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.04,
    kl_estimator: str = "k3",
    importance_sampling_level: str = "token",
    loss_agg_mode: str = "token-mean",
    max_length: int = 1,
) -> tuple[jax.Array, dict]:
  """(loss sum, {"count", "kl", "clip_fraction", "ratio"}), every entry a sum over `loss_agg_mode`'s units (tokens,
  or completions), so that each over "count" is its mean. All arrays [B, T], float32; `mask` 1 on completion tokens.

  Per token: -min(ratio * A, clip(ratio, 1 - epsilon, 1 + epsilon_high) * A) (GRPO eq. 3; DAPO eq. 10's
  clip-higher with epsilon_high; GSPO eq. 5 with a sequence ratio) + beta * KL (GRPO eq. 3's penalty).
  """
  ratio = importance_ratio(log_probs, old_log_probs, mask, importance_sampling_level)
  high = epsilon if epsilon_high is None else epsilon_high
  clipped = jnp.clip(ratio, 1 - epsilon, 1 + high)
  policy = -jnp.minimum(ratio * advantages, clipped * advantages)
  kl = (
      jnp.zeros_like(policy) if reference_log_probs is None else kl_estimate(log_probs, reference_log_probs, kl_estimator)
  )
  total, count = aggregate(policy + beta * kl, mask, loss_agg_mode, max_length)
  # The metrics are means over the same count: per token, or per completion of its token mean (a sum of tokens
  # would make clip_fraction no fraction).
  means = "token-mean" if loss_agg_mode == "token-mean" else "seq-mean-token-mean"
  metrics = {
      "count": count,
      "kl": aggregate(kl, mask, means)[0],
      "clip_fraction": aggregate((ratio != clipped).astype(jnp.float32), mask, means)[0],
      "ratio": aggregate(jax.lax.stop_gradient(ratio), mask, means)[0],
  }
  return total, metrics
