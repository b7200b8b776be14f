"""Multi-turn tool-use RL on a calculator: llama-tiny (byte tokens) learns to call `<calc>` and answer with its output.

    python examples/calculator_rl.py                      # Linen, then NNX
    python examples/calculator_rl.py --backend nnx --rl-steps 40

1. SFT warm-up on synthetic transcripts of the intended episode (`CalculatorEnv.expert_turns`):

       37*48?<calc>37*48</calc><out>1776</out>1776\\n

   with the loss on the model's turns only, for a few steps: the policy learns the format, and copies the
   operands and the tool's output only sometimes.
2. GRPO on episodes played through the engine's slots (`maxbridge.training.agentic_rl.train_agentic`), rollouts
   one policy version behind the learner (off_policy_steps=1), reward 1 for the right answer.

Prints each RL step (reward, staleness, rollout and learner tokens/s) and the mean reward of the first and last
steps; the reward rises above the warmed policy's. Both backends start from the same warmed weights.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import maxbridge as mb
from maxbridge.training import agentic_rl, recipe
from maxbridge.training.posttrain import agentic, sft

BACKENDS = {"linen": dict(pure_nnx=False, enable_nnx=False, pure_nnx_decoder=False), "nnx": {}}


def warm_up(steps: int, batch: int, learning_rate: float, seed: int = 0) -> dict:
  """SFT on expert transcripts (model turns as targets): the canonical parameters after `steps` steps."""
  config = mb.load_config(
      "llama-tiny",
      **BACKENDS["linen"],
      per_device_batch_size=batch,
      learning_rate=learning_rate,
      warmup_steps_fraction=0.0,
      steps=steps,
      seed=seed,
  )
  trainer = recipe.create_trainer(config)
  state = trainer.init_state(seed)
  env = agentic.CalculatorEnv()
  for step in range(steps):
    tasks = range(1_000_000 + step * batch, 1_000_000 + (step + 1) * batch)  # apart from the RL tasks' seeds
    episodes = [agentic.transcript(env, task, env.expert_turns(task)) for task in tasks]
    examples = [(np.asarray(e.tokens, np.int32), np.asarray(e.generated, bool)) for e in episodes]
    rows = sft.fill_rows([[i] for i in range(batch)], examples, config.max_target_length, True)
    state, metrics = trainer.train_step(state, rows)
    if step % 50 == 0 or step == steps - 1:
      print(f"sft step {step:4d}  loss {float(metrics['loss']):.4f}", flush=True)
  return trainer.model_params(state)


def rl(backend: str, params: dict, steps: int, args) -> list[dict]:
  config = mb.load_config(
      "llama-tiny",
      **BACKENDS[backend],
      use_grpo=True,
      grpo_beta=0.0,
      per_device_batch_size=args.tasks,
      num_generations=args.generations,
      max_concurrency=args.tasks * args.generations,
      learning_rate=args.rl_learning_rate,
      warmup_steps_fraction=0.0,
      steps=steps,
      off_policy_steps=1,
      decode_sampling_temperature=1.0,
  )

  def show(r):
    print(
        f"{backend} rl step {r['step']:3d}  reward {r['mean_reward']:.3f}  loss {r['loss']:+.4f}  "
        f"staleness {r['staleness']}  rollout {r['rollout_tokens_per_s']:6.0f} tok/s  "
        f"learner {r['learner_tokens_per_s']:7.0f} tok/s",
        flush=True,
    )

  return agentic_rl.train_agentic(config, agentic.CalculatorEnv, params=params, progress=show)[1]


def main():
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--backend", choices=("linen", "nnx", "both"), default="both")
  parser.add_argument("--sft-steps", type=int, default=100)
  parser.add_argument("--sft-learning-rate", type=float, default=3e-3)
  parser.add_argument("--rl-steps", type=int, default=40)
  parser.add_argument("--rl-learning-rate", type=float, default=3e-4)
  parser.add_argument("--tasks", type=int, default=8, help="tasks per RL step")
  parser.add_argument("--generations", type=int, default=4, help="episodes per task")
  args = parser.parse_args()
  began = time.perf_counter()
  params = warm_up(args.sft_steps, 16, args.sft_learning_rate)
  window = max(args.rl_steps // 4, 1)
  summary = {}
  for backend in ("linen", "nnx") if args.backend == "both" else (args.backend,):
    rewards = [r["mean_reward"] for r in rl(backend, params, args.rl_steps, args)]
    summary[backend] = (np.mean(rewards[:window]), np.mean(rewards[-window:]))
  for backend, (first, last) in summary.items():
    print(f"{backend}: mean reward, first {window} steps {first:.3f} -> last {window} steps {last:.3f}")
  print(f"total {time.perf_counter() - began:.0f} s")


if __name__ == "__main__":
  main()
