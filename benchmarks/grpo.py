"""Where a GRPO step's time goes: sampling vs scoring vs update, Linen and NNX side by side in one process.

    .venv/bin/python benchmarks/grpo.py [--preset llama-small] [--steps 5] [--prompts 4] [--generations 4]

Each round runs one GRPO step per backend, in turn, on the same seed (so both
sample the same completions): sampling (the engine's cached decoding from the
policy's parameters, `Rollouts`), scoring (the reward function and
packing, on the host) and the update (`Trainer.train_step`, waited for).
Reports the median seconds of each phase per backend and NNX / Linen.
"""

import argparse
import statistics
import time

import jax

import maxbridge as mb
from maxbridge.models import dispatch
from maxbridge.training import recipe
from maxbridge.training.posttrain import grpo


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="llama-small")
  parser.add_argument("--steps", type=int, default=5, help="timed rounds (one step per backend)")
  parser.add_argument("--warmup", type=int, default=1, help="untimed steps after the first (compiling) one")
  parser.add_argument("--prompts", type=int, default=4)
  parser.add_argument("--generations", type=int, default=4)
  parser.add_argument("--new-tokens", type=int, default=8)
  args = parser.parse_args()
  runs = {}
  for name in ("linen", "nnx"):
    config = mb.load_config(
        args.preset,
        use_grpo=True,
        per_device_batch_size=args.prompts,
        num_generations=args.generations,
        max_prefill_predict_length=6,
        max_target_length=6 + args.new_tokens,
        **dispatch.backend_flags(name),
    )
    trainer = recipe.create_trainer(config)
    state = trainer.init_state(config.seed)
    trainer.hold_frozen(state)
    runs[name] = [trainer, grpo.Rollouts(config, trainer), state]
  times = {name: {"sampling": [], "scoring": [], "update": []} for name in runs}
  for step in range(1 + args.warmup + args.steps):
    for name, run in runs.items():
      trainer, sampler, state = run
      batch, _ = sampler.batch(step, state)
      began = time.perf_counter()
      state, metrics = trainer.train_step(state, batch)
      jax.block_until_ready(metrics)
      run[2] = state
      if step > args.warmup:
        times[name]["sampling"].append(sampler.timings["sampling_s"])
        times[name]["scoring"].append(sampler.timings["scoring_s"])
        times[name]["update"].append(time.perf_counter() - began)
  print(
      f"{args.preset}, {jax.devices()[0].platform}: {args.prompts} prompts x {args.generations} generations, "
      f"{args.new_tokens} new tokens; median of {args.steps} steps"
  )
  print(f"{'phase':<10}{'linen s':>10}{'nnx s':>10}{'nnx/linen':>11}")
  for phase in ("sampling", "scoring", "update"):
    linen, nnx = (statistics.median(times[name][phase]) for name in ("linen", "nnx"))
    print(f"{phase:<10}{linen:>10.4f}{nnx:>10.4f}{nnx / linen:>11.2f}")


if __name__ == "__main__":
  main()
