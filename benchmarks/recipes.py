"""Training recipes side by side in one process: each one's train-step time vs its baseline, and its loss after N steps.

    .venv/bin/python benchmarks/recipes.py [--preset llama-small] [--steps 20] [--batch 4] [--length 128]
                                           [--rows muon distill distill-offline] [--backend nnx|linen]

Every row trains the same model from the same seed on the same batches (batch
i at step i), its steps interleaved with its baseline's in rounds of a fresh
random order (`bench.interleaved`), so machine noise lands on both alike. The
ratio is the median of per-round step-time ratios; the first call (trace +
compile + one step) is reported apart.

Rows (add a recipe as one more entry of `ROWS`: its config overrides and its baseline row):
- adamw: plain training, the baseline of the others.
- muon: opt_type=muon (optax.contrib.muon on the weight matrices, AdamW on the rest); muon-rms0.2 with
  muon_consistent_rms=0.2 (its updates at AdamW's RMS, so the same learning rate suits both).
- distill: an in-step teacher of the same model from another seed, alpha 0.5, T 2; vs plain training.
- distill-offline: the same teacher offline: its top-64 logits of the row's batches written first (`distill.write_logits`,
  what `maxbridge distill-logits` runs; not timed), then read with each batch (`distill_logits_path`), no teacher in
  the step; vs plain training.
- diloco: enable_diloco with H=10 on this process's devices as one replica (the step's own cost: the vmapped inner
  step and the outer step every H); its communication over "diloco" is printed below the table, computed from the
  parameter tree: one all-reduce of the parameters' size per outer step, against data parallelism's all-reduce of
  the gradients (the same size) every inner step.
- mtp: mtp_num_layers=1 (one DeepSeek-V3 multi-token prediction module, a decoder layer of the family, and its
  logits through the shared head), the step-time overhead over plain training; its held-out loss is the main one.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

import jax

from maxbridge.core.config import load_config
from maxbridge.models import dispatch
from maxbridge.training import bench, data, distill, recipe
from maxbridge.training.hooks import global_batch_size

# name -> (config overrides, the row it is compared with)
ROWS = {
    "adamw": ({}, None),
    "muon": ({"opt_type": "muon"}, "adamw"),
    "muon-rms0.2": ({"opt_type": "muon", "muon_consistent_rms": 0.2}, "adamw"),
    "distill": ({"teacher_overrides": "{seed: 1}", "distill_alpha": 0.5, "distill_temperature": 2.0}, "adamw"),
    # teacher_overrides here names the teacher whose logits main() writes; the row trains on them alone.
    "distill-offline": (
        {"teacher_overrides": "{seed: 1}", "distill_alpha": 0.5, "distill_temperature": 2.0, "eval_interval": 0},
        "adamw",
    ),
    "diloco": ({"enable_diloco": True, "diloco_sync_period": 10}, "adamw"),
    "mtp": ({"mtp_num_layers": 1}, "adamw"),
}


class Run:
  """One row's trainer and state, stepped on batch i at its i-th call."""

  def __init__(self, config):
    self.config = config
    self.dataset = data.make_dataset(config, "train", global_batch_size(config))
    self.logits = distill.OfflineLogits(config, global_batch_size(config)) if config.distill_logits_path else None
    self.step_index = 0
    self.trainer, self.state, self.first_call = bench.start(config, self._next_batch())
    self.loss = None

  def _next_batch(self):
    batch = self.dataset.batch(self.step_index)
    if self.logits is not None:  # the teacher's top-k logits of this batch
      batch = {**batch, **self.logits.batch(self.step_index)}
    self.step_index += 1
    return batch

  def __call__(self) -> float:
    batch = self._next_batch()
    self.state, seconds = bench.timed_step(self.trainer, self.state, batch)
    return seconds

  def eval_loss(self, batches) -> float:
    """The held-out cross-entropy of the main prediction."""
    # The main cross-entropy alone: a distilling row's loss mixes in its teacher's KL, an MTP row's its MTP loss.
    plain = self.config.replace(
        teacher_overrides="",
        distill_logits_path="",
        **({"mtp_loss_scaling_factor": 0.0} if self.config.mtp_num_layers else {}),
    )
    trainer, state = self.trainer, self.state
    if plain != self.config:  # the same parameters in a plain trainer's state
      trainer = recipe.create_trainer(plain)
      state = trainer.replace_params(trainer.init_state(plain.seed), self.trainer.params(self.state))
    return statistics.fmean(float(trainer.eval_step(state, b)["loss"]) for b in batches)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="llama-small")
  parser.add_argument("--steps", type=int, default=20, help="timed steps per row (after --warmup untimed ones)")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--length", type=int, default=128)
  parser.add_argument("--learning-rate", type=float, default=3e-3)
  parser.add_argument("--rows", nargs="+", choices=sorted(ROWS), default=sorted(ROWS))
  parser.add_argument("--backend", choices=("nnx", "linen"), default="nnx")
  args = parser.parse_args()
  rows = sorted({*args.rows, *(ROWS[r][1] for r in args.rows if ROWS[r][1])}, key=list(ROWS).index)
  total = 1 + args.warmup + args.steps
  common = dict(
      per_device_batch_size=args.batch,
      max_target_length=args.length,
      learning_rate=args.learning_rate,
      steps=total,
      **dispatch.backend_flags(args.backend),
  )
  folder = tempfile.TemporaryDirectory(prefix="recipes-")
  configs = {name: load_config(args.preset, **common, **ROWS[name][0]) for name in rows}
  if "distill-offline" in configs:
    configs["distill-offline"] = offline(configs["distill-offline"], Path(folder.name) / "teacher-logits")
  runs = {name: Run(config) for name, config in configs.items()}
  times = bench.interleaved(runs, args.steps, args.warmup)
  held_out = data.make_dataset(runs["adamw"].config, "eval", global_batch_size(runs["adamw"].config))
  batches = [held_out.batch(i) for i in range(2)]
  print(
      f"{args.preset} {args.backend}, batch {args.batch} x {args.length}, {total} steps "
      f"({args.steps} timed, interleaved), lr {args.learning_rate}"
  )
  print("| row | first call s | step ms (median) | vs baseline | held-out cross-entropy after the steps |")
  print("|---|---|---|---|---|")
  for name, run in runs.items():
    base = ROWS[name][1]
    ratio = f"{bench.median_ratio(times[name], times[base]):.2f}x {base}" if base else ""
    step_ms = 1e3 * statistics.median(times[name])
    print(f"| {name} | {run.first_call:.1f} | {step_ms:.1f} | {ratio} | {run.eval_loss(batches):.4f} |")
  if "diloco" in runs:
    print(diloco_communication(runs["diloco"].config, runs["diloco"].trainer.abstract_params))


def offline(config, destination: Path, top_k: int = 64):
  """`config` reading its teacher's top-k logits of every step's batch, written to `destination` first."""
  distill.write_logits(config, destination, top_k=top_k, steps=config.steps, rows=global_batch_size(config))
  return config.replace(teacher_overrides="", distill_logits_path=str(destination))


def diloco_communication(config, abstract_params) -> str:
  """Bytes each step all-reduces across replicas: DiLoCo's pseudo-gradient (one value per parameter, in its dtype)
  once per outer step, vs data parallelism's gradients (as many) every inner step."""
  size = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(abstract_params))
  h = config.diloco_sync_period
  return (
      f"DiLoCo over 'diloco': {size / 2**20:.1f} MiB all-reduced per outer step (every H={h} inner steps), "
      f"{size / h / 2**20:.2f} MiB per inner step on average; data parallelism across the same replicas: "
      f"{size / 2**20:.1f} MiB of gradients per inner step ({h}x DiLoCo's)"
  )


if __name__ == "__main__":
  main()
