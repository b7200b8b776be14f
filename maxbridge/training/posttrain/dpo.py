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
The pairs here are every pair loss's (ORPO's and SimPO's too); their shared
log-probabilities, masking and pure loss functions are `preference`'s.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.core.config import Config
from maxbridge.training.loss import Batch, Forward, Loss, StartingPolicy
from maxbridge.training.posttrain import preference, sft
from maxbridge.training.posttrain.preference import KEYS, segment_log_probs  # noqa: F401  (the pair losses' names)

SIDES = ("chosen", "rejected")
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

  def __call__(self, forward: Forward, batch: Batch, reference: Forward | None = None) -> tuple[jax.Array, dict]:
    if reference is None:
      raise ValueError("DPO needs a reference model: the frozen policy the run started from (Trainer.hold_frozen)")
    (chosen, rejected), counts, intermediates = preference.side_log_probs(forward, batch, SIDES)
    (ref_chosen, ref_rejected), _, _ = preference.side_log_probs(reference, batch, SIDES)
    losses, chosen_rewards, rejected_rewards = preference.dpo_loss(
        chosen, rejected, ref_chosen, ref_rejected, self.beta, self.label_smoothing
    )
    margins = chosen_rewards - rejected_rewards
    return preference.pair_total(
        losses,
        preference.pair_mask(*counts),
        intermediates,
        reward_accuracy=(margins > 0).astype(jnp.float32),
        chosen_rewards=chosen_rewards,
        rejected_rewards=rejected_rewards,
        margins=margins,
    )
