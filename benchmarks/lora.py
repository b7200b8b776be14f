"""LoRA vs full fine-tuning: train-step time and optimizer-state bytes, both backends, side by side.

    .venv/bin/python benchmarks/lora.py [--preset llama-small] [--rank 8] [--steps 10] [--batch 4] [--length 128]

Every variant is timed in the same rounds, in a fresh random order each round
(as `maxbridge/training/bench.py` does), and reported as the median of per-round
ratios to full fine-tuning on the same backend. Optimizer-state bytes are the
arrays of the state's optimizer part (Adam's mu and nu, counts), as checkpoints
store them; trained-parameter counts are what the optimizer updates.
"""

import argparse
import functools
import statistics

import jax
import numpy as np

import maxbridge as mb
from maxbridge.training import bench
from maxbridge.models import dispatch


def _bytes(tree) -> int:
  return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def _count(tree) -> int:
  return sum(int(np.prod(x.shape)) for x in jax.tree.leaves(tree))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="llama-small")
  parser.add_argument("--rank", type=int, default=8)
  parser.add_argument("--steps", type=int, default=10, help="timed rounds")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--length", type=int, default=128)
  args = parser.parse_args()
  if min(args.steps, args.batch, args.length, args.rank) < 1 or args.warmup < 0:
    parser.error("--steps, --batch, --length and --rank must be >= 1, --warmup >= 0")

  variants = {"full": {}, f"lora r={args.rank}": dict(lora_rank=args.rank, lora_alpha=2.0 * args.rank)}
  entries = {}
  for backend in ("linen", "nnx"):
    for variant, keys in variants.items():
      cfg = mb.load_config(
          args.preset,
          per_device_batch_size=args.batch,
          max_target_length=args.length,
          dataset_type="synthetic",
          **dispatch.backend_flags(backend),
          **keys,
      )
      batch = bench._first_batch(cfg)  # pylint: disable=protected-access
      trainer, state, compile_s = bench.start(cfg, batch)
      tree = trainer.to_checkpoint(trainer.abstract_state())
      entries[(backend, variant)] = dict(
          trainer=trainer,
          state=state,
          batch=batch,
          opt_bytes=_bytes(tree["opt_state"]),
          trained=_count(tree["params"]),
      )
      print(f"built {backend} {variant} (first step {compile_s:.1f} s)", flush=True)

  def time_step(entry):
    entry["state"], seconds = bench.timed_step(entry["trainer"], entry["state"], entry["batch"])
    return seconds

  steps = bench.interleaved(
      {key: functools.partial(time_step, entry) for key, entry in entries.items()}, args.steps, args.warmup
  )

  print(
      f"\n{args.preset}, batch {args.batch} x length {args.length}, {args.steps} interleaved rounds, "
      f"jax {jax.__version__} on {jax.devices()[0].platform}; 'vs full' = median of per-round ratios, same backend"
  )
  header = f"{'backend':<8}{'variant':<11}{'trained':>12}{'opt state MiB':>15}{'vs full':>9}{'step ms':>9}{'vs full':>9}"
  print(header)
  print("-" * len(header))
  for backend, variant in entries:
    entry, full = entries[(backend, variant)], entries[(backend, "full")]
    step_ratio = bench.median_ratio(steps[(backend, variant)], steps[(backend, "full")])
    print(
        f"{backend:<8}{variant:<11}{entry['trained']:>12,}{entry['opt_bytes'] / 2**20:>15.2f}"
        f"{entry['opt_bytes'] / full['opt_bytes']:>9.4f}{statistics.median(steps[(backend, variant)]) * 1e3:>9.1f}"
        f"{step_ratio:>9.2f}"
    )


if __name__ == "__main__":
  main()
