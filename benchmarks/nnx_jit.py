"""Why the NNX train step is `jax.jit` over split state: the same step under `nnx.jit`, side by side.

Both run the identical step function (`NNXTrainer._train_step`); only the
transform differs. `nnx.jit` takes the module object and splits/merges the
object graph on every call in Python; the trainer's `jax.jit` takes the
already-split state with the GraphDef static. Interleaved rounds, medians.

    python benchmarks/nnx_jit.py --preset llama-tiny --steps 50
"""

import argparse
import statistics
import time

import jax
from flax import nnx

import maxbridge as mb
from maxbridge.training import data
from maxbridge.training import recipe


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="llama-tiny")
  parser.add_argument("--steps", type=int, default=50)
  parser.add_argument("--batch", type=int, default=4)
  args = parser.parse_args()

  config = mb.load_config(args.preset, pure_nnx=True, enable_nnx=True, pure_nnx_decoder=True)
  trainer = recipe.create_trainer(config)
  batch = trainer.shard_batch(data.make_dataset(config, "train", args.batch).batch(0))

  state = trainer.init_state(0)
  module = nnx.merge(trainer.graphdef, trainer.init_state(0))

  @nnx.jit
  def nnx_jit_step(train_state, batch):
    new_state, metrics = trainer._train_step(nnx.state(train_state), batch)  # pylint: disable=protected-access
    nnx.update(train_state, new_state)
    return metrics

  def jax_jit():
    nonlocal state
    state, metrics = trainer.train_step(state, batch)
    return metrics

  runs = {"jax.jit over split state": jax_jit, "nnx.jit on the module": lambda: nnx_jit_step(module, batch)}
  times = {name: [] for name in runs}
  for name, run in runs.items():  # compile and warm up
    for _ in range(3):
      jax.block_until_ready(run())
  for _ in range(args.steps):
    for name, run in runs.items():
      began = time.perf_counter()
      jax.block_until_ready(run())
      times[name].append(time.perf_counter() - began)

  base = statistics.median(times["jax.jit over split state"])
  print(f"{args.preset}, batch {args.batch} x {config.max_target_length}, {args.steps} interleaved rounds")
  for name, samples in times.items():
    median = statistics.median(samples)
    print(f"  {name:28s} {median * 1e3:8.2f} ms   {median / base:5.2f}x")


if __name__ == "__main__":
  main()
