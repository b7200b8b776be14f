"""Kahneman-Tversky optimisation (KTO): unpaired rows, each a completion marked desirable or not.

A row is `{"prompt", "completion", "label": true/false}`. KTO's reference
point z_ref is an estimate of KL(pi || ref) from mismatched pairs: each
example's prompt with another example's completion (the previous row's in
the data's order, wrapping, as TRL shifts completions by one). So an example
is packed as DPO's pairs are, two sides in step: `completion_*` (prompt +
its completion) and `kl_*` (prompt + the previous row's completion), with
completion-only targets, and `desirable_segmentation` (int32 [rows, length]:
the segment id on the targets of desirable completions, 0 elsewhere) carrying
the labels. Through Grain (`grain_packing`) the previous example is the stream's,
and the stream's first example has no mismatched pair (left out of z_ref's mean).

The loss (Ethayarajh et al. 2024, eq. 8; `preference.kto_loss`), per example:

    r     = log pi(y|x) - log ref(y|x)                 (summed over completion tokens)
    z_ref = max(0, mean over the batch's mismatched pairs of the same difference)   (no gradient)
    loss  = lambda_D (1 - sigmoid(beta (r - z_ref)))   if desirable
            lambda_U (1 - sigmoid(beta (z_ref - r)))   otherwise

The batch z_ref averages over is the micro-batch the step computes (with gradient
accumulation, each micro-batch's own). The reference is the starting policy, as DPO's.
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.training.loss import Batch, Forward, Loss, StartingPolicy
from maxbridge.training.posttrain import dpo, preference, sft
from maxbridge.training.posttrain.preference import KEYS

SIDES = ("completion", "kl")
# (prompt + completion, prompt + another row's completion, desirable), each side an SFT example.
Example = tuple[sft.Example, sft.Example, bool]
# (prompt tokens, completion tokens, desirable) as read, before the mismatched pairs are formed.
Row = tuple[list[int], list[int], bool]


def record_row(record: dict, encode: sft.Encode = sft.byte_encode, where: str = "row") -> Row:
  """The row of one JSON object with string `prompt` and `completion` and a boolean `label`; refused naming
  `where`."""
  missing = [key for key in ("prompt", "completion") if not isinstance(record.get(key), str)]
  if missing:
    raise ValueError(
        f'{where}: a KTO row needs string "prompt" and "completion" fields and a boolean "label"; '
        f"missing or not a string: {missing}"
    )
  if not isinstance(record.get("label"), bool):
    raise ValueError(
        f'{where}: a KTO row needs a boolean "label" (true: the completion is desirable, false: undesirable), '
        f"got {record.get('label')!r}"
    )
  return encode(record["prompt"]), encode(record["completion"]), record["label"]


def jsonl_rows(path: Path, encode: sft.Encode = sft.byte_encode) -> list[Row]:
  return [record_row(record, encode, f"{path}:{number}") for number, record in sft.read_jsonl(path)]


def examples(rows: list[Row]) -> list[Example]:
  """Each row with its mismatched pair: its prompt and the previous row's completion (the last row's for the first)."""
  return [
      (sft.example(prompt, completion), sft.example(prompt, rows[i - 1][1]), desirable)
      for i, (prompt, completion, desirable) in enumerate(rows)
  ]


def fit_examples(items: list[Example], length: int, source: str) -> list[Example]:
  """Both sides of each example fitted to `length` (`sft.fit`: refused, naming the example, when a side keeps no
  completion token); those cut are counted in a warning."""
  fitted = []
  for i, (completion, kl, desirable) in enumerate(items):
    where = f"{source}, example {i}"
    fitted.append((sft.fit(completion, length, where), sft.fit(kl, length, f"{where} (mismatched pair)"), desirable))
  sft.warn_cut(source, sum(max(c[0].size, k[0].size) > length for c, k, _ in items), len(items), length)
  return fitted


def pack(items: list[Example], length: int) -> dict[str, np.ndarray]:
  """Examples into `completion_*` and `kl_*` rows of `length` in step, and `desirable_segmentation`."""
  cut = [tuple((t[:length], c[:length]) for t, c in sides[:2]) for sides in items]
  plan = sft.plan_rows([[side[0].size for side in sides] for sides in cut], length)
  rows = {}
  for i, side in enumerate(SIDES):
    filled = sft.fill_rows(plan, [sides[i] for sides in cut], length, completion_only=True)
    rows.update({f"{side}_{key}": value for key, value in filled.items()})
  segments = rows["completion_targets_segmentation"]
  desirable = np.zeros_like(segments)
  for r, row in enumerate(plan):
    for segment, index in enumerate(row, start=1):
      if items[index][2]:
        desirable[r] = np.where(segments[r] == segment, segment, desirable[r])
  rows["desirable_segmentation"] = desirable
  return rows


@functools.lru_cache(maxsize=1)
def builtin_rows() -> tuple[Row, ...]:
  """`dpo.arithmetic_preferences` unpaired: each prompt once with its right answer (desirable) and once with the
  wrong one (undesirable), in two passes of alternating labels, so that consecutive rows never share a prompt (each
  mismatched pair is one) and each packed row mixes both labels."""
  encode = sft.byte_encode
  prefs = dpo.arithmetic_preferences()
  rows = []
  for flip in (0, 1):
    for i, (prompt, right, wrong) in enumerate(prefs):
      desirable = (i + flip) % 2 == 0
      rows.append((encode(prompt), encode(right if desirable else wrong), desirable))
  return tuple(rows)


class KTO(Loss):
  """KTO against the starting policy; `tokens` in aux counts examples, so every metric is per example."""

  batch_keys = (*(f"{side}_{key}" for side in SIDES for key in KEYS), "desirable_segmentation")
  metric_keys = ("desirable_fraction", "desirable_rewards", "undesirable_rewards", "kl")
  frozen = StartingPolicy()  # the reference
  fixed_keys = ("use_kto",)

  def __init__(self, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
    self.beta, self.desirable_weight, self.undesirable_weight = beta, desirable_weight, undesirable_weight

  @classmethod
  def enabled(cls, config) -> bool:
    return config.use_kto

  @classmethod
  def from_config(cls, config) -> KTO:
    return cls(config.kto_beta, config.kto_desirable_weight, config.kto_undesirable_weight)

  def __call__(self, forward: Forward, batch: Batch, reference: Forward | None = None) -> tuple[jax.Array, dict]:
    if reference is None:
      raise ValueError("KTO needs a reference model: the frozen policy the run started from (Trainer.hold_frozen)")
    (log_probs, kl_log_probs), (count, kl_count), intermediates = preference.side_log_probs(forward, batch, SIDES)
    (ref_log_probs, kl_ref_log_probs), _, _ = preference.side_log_probs(reference, batch, SIDES)
    segments = batch["desirable_segmentation"]
    desirable = (preference.segment_sums((segments > 0).astype(jnp.float32), segments) > 0).astype(jnp.float32)
    present = (count > 0).astype(jnp.float32)
    losses, rewards, z_ref = preference.kto_loss(
        log_probs,
        ref_log_probs,
        jax.lax.stop_gradient(kl_log_probs),
        kl_ref_log_probs,
        desirable,
        (kl_count > 0).astype(jnp.float32),
        self.beta,
        self.desirable_weight,
        self.undesirable_weight,
    )
    return preference.pair_total(
        losses,
        present,
        intermediates,
        desirable_fraction=desirable,
        desirable_rewards=rewards * desirable,
        undesirable_rewards=rewards * (1 - desirable),
        kl=jnp.broadcast_to(z_ref, present.shape),
    )
