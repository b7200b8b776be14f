"""Asynchronous vs synchronous multi-turn rollouts on the same budget: wall time and tokens/s side by side.

    .venv/bin/python benchmarks/agentic_rollouts.py [--preset llama-tiny] [--steps 8] [--backend linen]

The same GRPO run on `CalculatorEnv` (the same steps, tasks and episodes per step, from the same weights) twice:
off_policy_steps=0 (sample step k's episodes with version k, then train) and off_policy_steps=1 (step k's
episodes sampled with version k - 1 in a thread while the learner trains on step k - 1's). One trainer and one
rollout engine serve both, compiled by an untimed run of two steps; the modes run `--rounds` times, interleaved,
and each mode's fastest run is reported. Reports each run's wall time, the mean
rollout and learner tokens/s of its steps (model tokens per second of sampling; packed tokens per second of
the update) and the speed-up.
"""

import argparse

import numpy as np

import maxbridge as mb
from maxbridge.models import dispatch
from maxbridge.training import agentic_rl, recipe
from maxbridge.training.posttrain import agentic


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="llama-tiny")
  parser.add_argument("--backend", choices=tuple(dispatch.BACKENDS), default="linen")
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--rounds", type=int, default=2, help="timed runs of each mode, interleaved")
  parser.add_argument("--tasks", type=int, default=4, help="tasks per step")
  parser.add_argument("--generations", type=int, default=4, help="episodes per task")
  args = parser.parse_args()
  config = mb.load_config(
      args.preset,
      **dispatch.backend_flags(args.backend),
      use_grpo=True,
      per_device_batch_size=args.tasks,
      num_generations=args.generations,
      max_concurrency=args.tasks * args.generations,
      max_target_length=64,
      warmup_steps_fraction=0.0,
      learning_rate=1e-4,
  )
  trainer = recipe.create_trainer(config, loss=agentic.policy_loss(config))
  params = mb.create_model(config, seed=config.seed).params()
  engine = agentic.rollout_engine(config, params)
  shared = dict(trainer=trainer, engine=engine, params=params)
  # Untimed: compiles, on version 0's parameters and on a trained version's (placed anew).
  agentic_rl.train_agentic(config.replace(off_policy_steps=0), agentic.CalculatorEnv, steps=2, **shared)
  rows = {}
  for lag in (0, 1) * args.rounds:  # interleaved; each mode's fastest round is reported
    records = agentic_rl.train_agentic(
        config.replace(off_policy_steps=lag), agentic.CalculatorEnv, steps=args.steps, **shared
    )[1]
    if lag in rows and rows[lag][0] <= records[-1]["elapsed_s"]:
      continue
    rows[lag] = (
        records[-1]["elapsed_s"],
        float(np.mean([r["rollout_tokens_per_s"] for r in records])),
        float(np.mean([r["learner_tokens_per_s"] for r in records])),
        sum(r["model_tokens"] * args.tasks * args.generations for r in records) / records[-1]["elapsed_s"],
        max(r["staleness"] for r in records),
    )
  print(f"{args.preset} {args.backend}: {args.steps} steps x {args.tasks * args.generations} episodes")
  print(f"{'':14s}{'wall s':>9s}{'rollout tok/s':>15s}{'learner tok/s':>15s}{'end-to-end tok/s':>18s}{'staleness':>11s}")
  for lag, name in ((0, "synchronous"), (1, "asynchronous")):
    wall, rollout, learner, overall, staleness = rows[lag]
    print(f"{name:14s}{wall:9.2f}{rollout:15.0f}{learner:15.0f}{overall:18.0f}{staleness:11d}")
  print(f"speed-up (sync wall / async wall): {rows[0][0] / rows[1][0]:.2f}x")


if __name__ == "__main__":
  main()
