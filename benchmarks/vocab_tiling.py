"""Vocabulary tiling: the train step's compiled temporary memory and step time, tiled vs untiled, side by side.

    .venv/bin/python benchmarks/vocab_tiling.py [--vocab 32768 131072] [--tiles 4 8] [--steps 3]
                                                [--batch 16] [--length 256] [--remat full]
                                                [--preset llama-small]

For each vocabulary size and backend (pure Linen, pure NNX), the untiled step
and the tiled ones (num_vocab_tiling = N) are compiled and timed in one
process. `temp` is XLA's `memory_analysis().temp_size_in_bytes` of the whole
train step; `saved` is how much of the float32 logits' size [B, T, V] x 4
bytes tiling removed from it. Targets: saved >= (N-1)/N of the logits, and
time <= 1.1x untiled.

Tiling removes the logits, so it can only lower the step's peak to the next
largest working set: the optimizer update (which grows with the vocab x
embedding tables) or a layer's backward (attention scores without remat).
The defaults are a training shape where the logits dominate, as they do at
scale: 4096 tokens per device, remat full. With llama-small and fewer tokens
than ~8x the embedding width, the peak is elsewhere and `saved` falls short
of the target although the logits are gone. Step times are medians of interleaved rounds (each
round runs every variant once), so machine noise lands on all alike.
"""

import argparse
import statistics
import time

import jax
import numpy as np

import maxbridge as mb
from maxbridge.training import data
from maxbridge.training import recipe

BACKENDS = {"linen": (False, False, False), "nnx": (True, True, True)}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="llama-small")
  parser.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072])
  parser.add_argument("--tiles", type=int, nargs="+", default=[4, 8])
  parser.add_argument("--batch", type=int, default=16, help="per_device_batch_size")
  parser.add_argument("--length", type=int, default=256, help="max_target_length")
  parser.add_argument("--remat", default="full", help="remat_policy")
  parser.add_argument("--steps", type=int, default=3, help="timed rounds")
  args = parser.parse_args()

  print(f"{args.preset}, batch {args.batch} x length {args.length}, remat {args.remat}, {jax.device_count()} device(s)")
  print(
      f"{'vocab':>7} {'backend':>7} {'N':>3} {'temp MiB':>9} {'saved/logits':>12} {'target':>7} {'s/step':>8} {'time ratio':>10}"
  )
  for vocab in args.vocab:
    logits_bytes = args.batch * jax.device_count() * args.length * vocab * 4
    variants = {}
    for backend, flags in BACKENDS.items():
      for tiles in [1, *args.tiles]:
        pure_nnx, enable_nnx, decoder = flags
        config = mb.load_config(
            args.preset,
            vocab_size=vocab,
            per_device_batch_size=args.batch,
            max_target_length=args.length,
            num_vocab_tiling=tiles,
            remat_policy=args.remat,
            pure_nnx=pure_nnx,
            enable_nnx=enable_nnx,
            pure_nnx_decoder=decoder,
            dataset_type="synthetic",
        )
        trainer = recipe.create_trainer(config)
        global_batch = args.batch * jax.device_count()
        batch = trainer.shard_batch(data.make_dataset(config, "train", global_batch).batch(0))
        state = trainer.init_state(0)
        # One compile serves both measurements: its memory analysis, and the steps timed below.
        compiled, step = trainer.compile_train_step(state, batch)
        state, _ = step(state)  # the first run outside the timing
        variants[backend, tiles] = {
            "temp": compiled.memory_analysis().temp_size_in_bytes,
            "step": step,
            "state": state,
            "times": [],
        }
        print(f"  compiled {backend} N={tiles}", flush=True)
    for _ in range(args.steps):
      for key in np.random.permutation(len(variants)):
        variant = list(variants.values())[key]
        start = time.perf_counter()
        variant["state"], metrics = variant["step"](variant["state"])
        jax.block_until_ready(metrics)
        variant["times"].append(time.perf_counter() - start)
    for (backend, tiles), variant in variants.items():
      untiled = variants[backend, 1]
      seconds = statistics.median(variant["times"])
      ratio = statistics.median(t / u for t, u in zip(variant["times"], untiled["times"]))
      saved = (untiled["temp"] - variant["temp"]) / logits_bytes
      target = f"{(tiles - 1) / tiles:.2f}" if tiles > 1 else "-"
      print(
          f"{vocab:>7} {backend:>7} {tiles:>3} {variant['temp'] / 2**20:>9.1f} {saved:>12.2f} {target:>7} "
          f"{seconds:>8.3f} {ratio:>10.3f}"
      )
    del variants


if __name__ == "__main__":
  main()
