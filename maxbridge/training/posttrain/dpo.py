"""Direct preference optimisation (DPO): preference data and the sigmoid loss with label smoothing.

A preference is a prompt with a `chosen` and a `rejected` completion. Pairs
are packed as SFT examples are, but in step: pair i sits in the same row and
segment of the chosen rows as of the rejected rows, so one segment sum gives
each completion's log-probability. Batch keys are MaxText's five per side,
prefixed: `chosen_inputs`, ..., `rejected_targets_segmentation`; only
completion tokens have nonzero `*_targets_segmentation`.

The loss (Rafailov et al. 2023; label smoothing as conservative DPO), per pair:

    z    = beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected)))
    loss = -(1 - label_smoothing) * log sigmoid(z) - label_smoothing * log sigmoid(-z)

with log-probabilities summed over completion tokens. The reference is the
policy the run started from (`loss.StartingPolicy`); its pass gets no gradient.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.core.config import Config
from maxbridge.training.loss import Batch, CrossEntropy, Forward, Loss, StartingPolicy
from maxbridge.training.posttrain import sft

SIDES = ("chosen", "rejected")
KEYS = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")
# (prompt + chosen, prompt + rejected), each an SFT example (tokens, completion mask).
Pair = tuple[sft.Example, sft.Example]


def arithmetic_preferences(max_operand: int = sft.ARITHMETIC_MAX) -> list[tuple[str, str, str]]:
  """The built-in preference set: (prompt, right answer, a wrong answer off by 1 to 3), fixed order."""
  offsets = np.random.default_rng(1).choice([-3, -2, -1, 1, 2, 3], size=(max_operand + 1) ** 2)
  rows = []
  for (prompt, answer), offset in zip(sft.arithmetic_pairs(max_operand), offsets):
    wrong = int(answer) + int(offset)
    rows.append((prompt, answer, f"{wrong if wrong >= 0 else int(answer) + 1}\n"))
  return rows


def pair(prompt: list[int], chosen: list[int], rejected: list[int]) -> Pair:
  return sft.example(prompt, chosen), sft.example(prompt, rejected)


def jsonl_pairs(path: Path, encode: sft.Encode = sft.byte_encode, length: int | None = None) -> list[Pair]:
  """Pairs from rows with string `prompt`, `chosen` and `rejected`; with `length` (max_target_length), fitted
  to it (`fit_pairs`) and named by their line on a refusal."""
  pairs, lines = [], []
  for number, record in sft.read_jsonl(path):
    pairs.append(record_pair(record, encode, f"{path}:{number}"))
    lines.append(number)
  return pairs if length is None else fit_pairs(pairs, length, str(path), lines)


def record_pair(record: dict, encode: sft.Encode = sft.byte_encode, where: str = "row") -> Pair:
  """The pair of one row (a JSON object with string `prompt`, `chosen` and `rejected`); refused naming `where`."""
  missing = [key for key in ("prompt", *SIDES) if not isinstance(record.get(key), str)]
  if missing:
    raise ValueError(
        f'{where}: a preference row needs string "prompt", "chosen" and "rejected" fields; '
        f"missing or not a string: {missing}"
    )
  return pair(*(encode(record[key]) for key in ("prompt", *SIDES)))


def fit_pair(sides: Pair, length: int, where: str) -> Pair:
  """Each side fitted to `length` tokens (`sft.fit`, naming the side on a refusal)."""
  return tuple(sft.fit(e, length, f"{where} ({side})") for e, side in zip(sides, SIDES))


def fit_pairs(pairs: list[Pair], length: int, source: str, lines: list[int] | None = None) -> list[Pair]:
  """Each side of each pair fitted to `length` tokens (`sft.fit`: a side with no completion token left is
  refused); the pairs cut on either side are counted in a warning."""
  fitted = []
  for i, sides in enumerate(pairs):
    fitted.append(fit_pair(sides, length, f"{source}:{lines[i]}" if lines else f"{source}, pair {i}"))
  sft.warn_cut(source, sum(max(e[0].size for e in sides) > length for sides in pairs), len(pairs), length)
  return fitted


def pack_pairs(pairs: list[Pair], length: int) -> dict[str, np.ndarray]:
  """Pairs into chosen and rejected rows of `length`, in step; completion tokens only are targets.

  A side longer than a row is cut to `length` tokens (callers fit pairs first, `fit_pairs`)."""
  cut = [tuple((t[:length], c[:length]) for t, c in p) for p in pairs]
  plan = sft.plan_rows([[side[0].size for side in p] for p in cut], length)
  rows = {}
  for i, side in enumerate(SIDES):
    filled = sft.fill_rows(plan, [p[i] for p in cut], length, completion_only=True)
    rows.update({f"{side}_{key}": value for key, value in filled.items()})
  return rows


@functools.lru_cache(maxsize=1)
def builtin_pairs() -> tuple[Pair, ...]:
  encode = sft.byte_encode
  return tuple(pair(encode(p), encode(c), encode(r)) for p, c, r in arithmetic_preferences())


def segment_log_probs(logits: jax.Array, targets: jax.Array, segments: jax.Array) -> tuple[jax.Array, jax.Array]:
  """(sum of target log-probabilities, target count) per (row, segment): float32 [rows, length + 1].

  Column s is segment s; column 0 gathers the tokens with no target and is never read.
  """
  log_probs = jax.nn.log_softmax(logits.astype(jnp.float32))
  per_token = jnp.take_along_axis(log_probs, targets[..., None], -1)[..., 0]
  per_token = jnp.where(segments > 0, per_token, 0.0)
  rows = jnp.arange(segments.shape[0])[:, None]
  zeros = jnp.zeros((segments.shape[0], segments.shape[1] + 1), jnp.float32)
  return zeros.at[rows, segments].add(per_token), zeros.at[rows, segments].add((segments > 0).astype(jnp.float32))


class DPO(Loss):
  """Sigmoid DPO with label smoothing; `tokens` in aux counts pairs, so every metric is per pair."""

  batch_keys = tuple(f"{side}_{key}" for side in SIDES for key in KEYS)
  metric_keys = ("reward_accuracy", "chosen_rewards", "rejected_rewards", "margins")
  frozen = StartingPolicy()  # the reference
  fixed_keys = ("use_dpo",)

  def __init__(self, beta: float = 0.1, label_smoothing: float = 0.0):
    self.beta = beta
    self.label_smoothing = label_smoothing

  @classmethod
  def enabled(cls, config: Config) -> bool:
    return config.use_dpo

  @classmethod
  def from_config(cls, config: Config) -> DPO:
    return cls(config.dpo_beta, config.dpo_label_smoothing)

  def _log_probs(self, forward: Forward, batch: Batch) -> tuple[tuple[jax.Array, jax.Array], dict]:
    """(chosen, rejected) completion log-probabilities per (row, segment), from one pass over both."""
    both = {key: jnp.concatenate([batch[f"{side}_{key}"] for side in SIDES]) for key in KEYS}
    logits, intermediates = forward(both["inputs"], both["inputs_position"], both["inputs_segmentation"])
    sums, counts = segment_log_probs(logits, both["targets"], both["targets_segmentation"])
    half = sums.shape[0] // 2
    return (sums[:half], sums[half:]), (counts[:half], counts[half:]), intermediates

  def __call__(self, forward: Forward, batch: Batch, reference: Forward | None = None) -> tuple[jax.Array, dict]:
    if reference is None:
      raise ValueError("DPO needs a reference model: the frozen policy the run started from (Trainer.hold_frozen)")
    (chosen, rejected), (chosen_count, rejected_count), intermediates = self._log_probs(forward, batch)
    (ref_chosen, ref_rejected), _, _ = self._log_probs(reference, batch)
    pairs = ((chosen_count > 0) & (rejected_count > 0)).astype(jnp.float32)
    chosen_rewards = self.beta * (chosen - jax.lax.stop_gradient(ref_chosen))
    rejected_rewards = self.beta * (rejected - jax.lax.stop_gradient(ref_rejected))
    return self.total(chosen_rewards, rejected_rewards, pairs, intermediates)

  def total(self, chosen_rewards, rejected_rewards, pairs, intermediates) -> tuple[jax.Array, dict]:
    """The loss summed over `pairs` (a 0/1 mask), and the metrics' sums: from per-pair rewards."""
    margins = chosen_rewards - rejected_rewards
    losses = -(1 - self.label_smoothing) * jax.nn.log_sigmoid(margins) - self.label_smoothing * jax.nn.log_sigmoid(
        -margins
    )
    loss, aux = CrossEntropy.total(jnp.sum(losses * pairs), jnp.float32(0.0), pairs, intermediates)
    del aux["z_loss"]
    aux["reward_accuracy"] = jnp.sum((margins > 0) * pairs)
    aux["chosen_rewards"] = jnp.sum(chosen_rewards * pairs)
    aux["rejected_rewards"] = jnp.sum(rejected_rewards * pairs)
    aux["margins"] = jnp.sum(margins * pairs)
    return loss, aux
