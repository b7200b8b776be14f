"""The DPO family's shared parts: per-completion log-probabilities, masking, and each loss as a pure function.

Pair data (`dpo.pair`, `dpo.pack_pairs`: chosen and rejected rows packed in
step, completion-only targets) is DPO's and every pair loss reads it; KTO's
unpaired rows are `kto`'s. A loss runs one forward pass over both sides of its
rows (`side_log_probs`) and reads each completion's log-probability as the sum
over its target tokens and their count (`segment_log_probs`), per (row,
segment); a (row, segment) with no completion token on a side is masked out
(`pair_mask`).

Each loss's core takes those arrays and nothing else, so that a test can call
it without a model (`dpo_loss`, `orpo_loss`, `simpo_loss`, `kto_loss`). The
Loss classes sum it over the pairs (or KTO's examples) and count them in
aux["tokens"]: every reported figure is per pair.

ORPO (Hong et al. 2024, eq. 6-7), per pair, with no reference model:

    log P(y)  = (1/|y|) sum_t log pi(y_t | x, y_<t)         (the per-token mean)
    log odds  = log P - log(1 - P)
    loss      = -log P(y_w) + lambda * -log sigmoid(log odds(y_w) - log odds(y_l))

The SFT term is the chosen completion's token-mean NLL of each pair (eq. 6's
L_SFT per pair), not TRL's token mean over the batch's chosen tokens, so the
run's loss is the mean over pairs of eq. 6 (as DPO's, whose every figure is per
pair). Tunix's ORPO puts the summed log-probabilities into the odds; the paper
and TRL use the per-token mean, as here.

SimPO (Meng et al. 2024, eq. 6), per pair, with no reference model:

    loss = -log sigmoid(beta / |y_w| log pi(y_w|x) - beta / |y_l| log pi(y_l|x) - gamma)

with gamma the margin itself (eq. 6's, TRL's `simpo_gamma`), not the paper's
tables' gamma/beta ratio; label smoothing as DPO's (TRL's CPO/SimPO).

KTO (Ethayarajh et al. 2024, eq. 8) is in `kto`; its core is `kto_loss` here.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxbridge.ops.losses import token_log_probs
from maxbridge.training.loss import Batch, CrossEntropy, Forward, Loss

KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")
# A completion's mean log-probability is kept below 0 by this much before its log odds: log(1 - P) is -inf at
# P = 1 (a completion the model is certain of, or a masked pair's 0 / 0), and its gradient NaN.
_LOG_PROB_CEILING = -1e-7


def segment_log_probs(logits: jax.Array, targets: jax.Array, segments: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum of target log-probabilities, target count) per (row, segment): float32 [rows, length + 1].

  Column s is segment s; column 0 gathers the tokens with no target and is never read.
  """
  per_token = jnp.where(segments > 0, token_log_probs(logits, targets), 0.0)
  return segment_sums(per_token, segments), segment_sums((segments > 0).astype(jnp.float32), segments)


def segment_sums(values: jax.Array, segments: jax.Array) -> jax.Array:
  """`values` [rows, length] summed per (row, segment): float32 [rows, length + 1], column s segment s."""
  rows = jnp.arange(segments.shape[0])[:, None]
  zeros = jnp.zeros((segments.shape[0], segments.shape[1] + 1), jnp.float32)
  return zeros.at[rows, segments].add(values.astype(jnp.float32))


def side_log_probs(forward: Forward, batch: Batch, sides: tuple[str, str]) -> tuple[tuple, tuple, dict]:
  """((sums per side), (counts per side), intermediates) from one pass over both sides' rows (`{side}_{key}`)."""
  both = {key: jnp.concatenate([batch[f"{side}_{key}"] for side in sides]) for key in KEYS}
  logits, intermediates = forward(both["inputs"], both["inputs_position"], both["inputs_segmentation"])
  sums, counts = segment_log_probs(logits, both["targets"], both["targets_segmentation"])
  half = sums.shape[0] // 2
  return (sums[:half], sums[half:]), (counts[:half], counts[half:]), intermediates


def pair_mask(chosen_count: jax.Array, rejected_count: jax.Array) -> jax.Array:
  """1.0 where a (row, segment) holds a pair (a completion token on both sides), else 0.0."""
  return ((chosen_count > 0) & (rejected_count > 0)).astype(jnp.float32)


def mean_log_probs(sums: jax.Array, counts: jax.Array) -> jax.Array:
  """Each completion's per-token mean log-probability; 0 where it has no token (masked by the caller)."""
  return sums / jnp.maximum(counts, 1.0)


def log_odds(mean_log_prob: jax.Array) -> jax.Array:
  """log(P / (1 - P)) of P = exp(mean_log_prob) (ORPO's odds), via expm1 for P near 1."""
  x = jnp.minimum(mean_log_prob, _LOG_PROB_CEILING)
  return x - jnp.log(-jnp.expm1(x))


def sigmoid_loss(z: jax.Array, label_smoothing: float) -> jax.Array:
  """-log sigmoid(z), with `label_smoothing` of the pairs taken as flipped (conservative DPO)."""
  return -(1 - label_smoothing) * jax.nn.log_sigmoid(z) - label_smoothing * jax.nn.log_sigmoid(-z)


def dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta: float, label_smoothing: float = 0.0):
  """(loss, chosen reward, rejected reward) per pair from summed log-probabilities (Rafailov et al. 2023, eq. 7)."""
  chosen_rewards = beta * (chosen - jax.lax.stop_gradient(ref_chosen))
  rejected_rewards = beta * (rejected - jax.lax.stop_gradient(ref_rejected))
  return sigmoid_loss(chosen_rewards - rejected_rewards, label_smoothing), chosen_rewards, rejected_rewards


def orpo_loss(chosen, chosen_count, rejected, rejected_count, lam: float):
  """(loss, odds-ratio term's log sigmoid, log odds ratio, chosen NLL) per pair (Hong et al. 2024, eq. 6-7)."""
  chosen_mean, rejected_mean = mean_log_probs(chosen, chosen_count), mean_log_probs(rejected, rejected_count)
  ratio = log_odds(chosen_mean) - log_odds(rejected_mean)
  log_sigmoid_ratio = jax.nn.log_sigmoid(ratio)
  nll = -chosen_mean
  return nll - lam * log_sigmoid_ratio, log_sigmoid_ratio, ratio, nll


def simpo_loss(chosen, chosen_count, rejected, rejected_count, beta: float, gamma: float, label_smoothing=0.0):
  """(loss, chosen reward, rejected reward) per pair, rewards beta times the mean log-probability (Meng et al. 2024,
  eq. 6)."""
  chosen_rewards = beta * mean_log_probs(chosen, chosen_count)
  rejected_rewards = beta * mean_log_probs(rejected, rejected_count)
  return sigmoid_loss(chosen_rewards - rejected_rewards - gamma, label_smoothing), chosen_rewards, rejected_rewards


def kto_loss(
    log_probs,
    ref_log_probs,
    kl_log_probs,
    kl_ref_log_probs,
    desirable,
    kl_present,
    beta: float,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
):
  """(loss, reward, z_ref) per example (Ethayarajh et al. 2024, eq. 8), from summed log-probabilities.

  r = log pi(y|x) - log ref(y|x); z_ref = max(0, the mean over the batch's mismatched examples (`kl_present`) of
  the same difference), with no gradient (as the paper and TRL); `desirable` (0/1) picks each example's value:

      desirable:   lambda_D * (1 - sigmoid(beta * (r - z_ref)))
      undesirable: lambda_U * (1 - sigmoid(beta * (z_ref - r)))

  The caller masks the losses of the (row, segment)s that hold no example.
  """
  kl = jnp.sum((kl_log_probs - kl_ref_log_probs) * kl_present) / jnp.maximum(jnp.sum(kl_present), 1.0)
  z_ref = jax.lax.stop_gradient(jnp.maximum(kl, 0.0))
  r = log_probs - jax.lax.stop_gradient(ref_log_probs)
  losses = jnp.where(
      desirable > 0,
      desirable_weight * (1 - jax.nn.sigmoid(beta * (r - z_ref))),
      undesirable_weight * (1 - jax.nn.sigmoid(beta * (z_ref - r))),
  )
  return losses, beta * r, z_ref


def pair_total(losses, pairs, intermediates, **metrics) -> tuple[jax.Array, dict]:
  """The loss summed over `pairs` (a 0/1 mask), aux["tokens"] the pair count, and each metric's sum over them."""
  loss, aux = CrossEntropy.total(jnp.sum(losses * pairs), jnp.float32(0.0), pairs, intermediates)
  del aux["z_loss"]
  for key, value in metrics.items():
    aux[key] = jnp.sum(value * pairs)
  return loss, aux


class ORPO(Loss):
  """Odds-ratio preference optimisation on DPO's pairs: the chosen side's SFT term plus the odds-ratio term."""

  sides = ("chosen", "rejected")
  batch_keys = tuple(f"{side}_{key}" for side in sides for key in KEYS)
  metric_keys = ("nll_loss", "log_odds_ratio", "log_odds_chosen", "reward_accuracy", "chosen_rewards", "rejected_rewards")
  frozen = None  # no reference model
  fixed_keys = ("use_orpo",)

  def __init__(self, lam: float = 0.1):
    self.lam = lam

  @classmethod
  def enabled(cls, config) -> bool:
    return config.use_orpo

  @classmethod
  def from_config(cls, config) -> ORPO:
    return cls(config.orpo_lambda)

  def __call__(self, forward: Forward, batch: Batch, reference: Forward | None = None) -> tuple[jax.Array, dict]:
    (chosen, rejected), (chosen_count, rejected_count), intermediates = side_log_probs(forward, batch, self.sides)
    losses, log_sigmoid_ratio, ratio, nll = orpo_loss(chosen, chosen_count, rejected, rejected_count, self.lam)
    # TRL's rewards: lambda times each side's mean log-probability.
    chosen_rewards = self.lam * mean_log_probs(chosen, chosen_count)
    rejected_rewards = self.lam * mean_log_probs(rejected, rejected_count)
    return pair_total(
        losses,
        pair_mask(chosen_count, rejected_count),
        intermediates,
        nll_loss=nll,
        log_odds_ratio=log_sigmoid_ratio,
        log_odds_chosen=ratio,
        reward_accuracy=(chosen_rewards > rejected_rewards).astype(jnp.float32),
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
    )


class SimPO(Loss):
  """Simple preference optimisation on DPO's pairs: length-normalised rewards and a target margin, no reference."""

  sides = ("chosen", "rejected")
  batch_keys = tuple(f"{side}_{key}" for side in sides for key in KEYS)
  metric_keys = ("reward_accuracy", "chosen_rewards", "rejected_rewards", "margins")
  frozen = None  # no reference model
  fixed_keys = ("use_simpo",)

  def __init__(self, beta: float = 2.0, gamma: float = 0.5, label_smoothing: float = 0.0):
    self.beta, self.gamma, self.label_smoothing = beta, gamma, label_smoothing

  @classmethod
  def enabled(cls, config) -> bool:
    return config.use_simpo

  @classmethod
  def from_config(cls, config) -> SimPO:
    return cls(config.simpo_beta, config.simpo_gamma, config.simpo_label_smoothing)

  def __call__(self, forward: Forward, batch: Batch, reference: Forward | None = None) -> tuple[jax.Array, dict]:
    (chosen, rejected), (chosen_count, rejected_count), intermediates = side_log_probs(forward, batch, self.sides)
    losses, chosen_rewards, rejected_rewards = simpo_loss(
        chosen, chosen_count, rejected, rejected_count, self.beta, self.gamma, self.label_smoothing
    )
    margins = chosen_rewards - rejected_rewards
    return pair_total(
        losses,
        pair_mask(chosen_count, rejected_count),
        intermediates,
        reward_accuracy=(margins > 0).astype(jnp.float32),
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        margins=margins,
    )
