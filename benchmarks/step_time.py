"""Train-step time of the flag combinations, side by side in one process, as ratios to pure Linen.

    .venv/bin/python benchmarks/step_time.py [--steps 15] [--combos all|minimal] [--scan both|true|false]

The same as `maxbridge bench <preset> per_device_batch_size=4 max_target_length=128`;
how it times and what the columns mean: `maxbridge/training/bench.py`.
"""

import argparse

from maxbridge.training import bench


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="llama-small")
  parser.add_argument("--steps", type=int, default=bench.DEFAULT_STEPS, help="timed rounds (one step per combination)")
  parser.add_argument("--warmup", type=int, default=bench.DEFAULT_WARMUP, help="untimed steps after the first call")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--length", type=int, default=128)
  parser.add_argument("--combos", choices=sorted(bench.COMBOS), default="all")
  parser.add_argument("--scan", choices=sorted(bench.SCANS), default="both")
  args = parser.parse_args()
  if min(args.steps, args.batch, args.length) < 1 or args.warmup < 0:
    parser.error("--steps, --batch and --length must be >= 1, --warmup >= 0")
  bench.step_time(
      args.preset,
      f"per_device_batch_size={args.batch}",
      f"max_target_length={args.length}",
      steps=args.steps,
      warmup=args.warmup,
      combos=args.combos,
      scan=args.scan,
  )


if __name__ == "__main__":
  main()
