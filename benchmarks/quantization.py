"""Quantized (AQT int8, Qwix int8) vs float32: train-step time and prefill throughput, both backends, side by side.

    .venv/bin/python benchmarks/quantization.py [--preset llama-small] [--steps 10] [--batch 4] [--length 128]

Every variant is timed in the same rounds, in a fresh random order each round
(as `maxbridge/bench.py` does), and reported as the median of per-round
ratios to float32 on the same backend. Prefill is one jitted forward pass
over a [batch, length] prompt (logits of every position), as tokens/s.
"""

import argparse
import statistics
import time

import jax
import numpy as np

import maxbridge as mb
from maxbridge import bench, dispatch

VARIANTS = {
    "f32": {},
    "aqt int8": dict(quantization="int8"),
    "qwix int8": dict(quantization="int8", use_qwix_quantization=True),
}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="llama-small")
  parser.add_argument("--steps", type=int, default=10, help="timed rounds")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--length", type=int, default=128)
  args = parser.parse_args()
  if min(args.steps, args.batch, args.length) < 1 or args.warmup < 0:
    parser.error("--steps, --batch and --length must be >= 1, --warmup >= 0")

  entries = {}
  for backend in ("linen", "nnx"):
    for variant, keys in VARIANTS.items():
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
      model = mb.create_model(cfg, seed=0)
      prompt = np.asarray(batch["inputs"])
      prefill = jax.jit(model.apply)
      params = model.params()
      prefill(params, prompt).block_until_ready()
      entries[(backend, variant)] = dict(
          trainer=trainer, state=state, batch=batch, compile_s=compile_s, prefill=prefill, params=params, prompt=prompt
      )
      print(f"built {backend} {variant} (first step {compile_s:.1f} s)", flush=True)

  def time_step(entry):
    entry["state"], seconds = bench.timed_step(entry["trainer"], entry["state"], entry["batch"])
    return seconds

  def time_prefill(entry):
    start = time.perf_counter()
    entry["prefill"](entry["params"], entry["prompt"]).block_until_ready()
    return time.perf_counter() - start

  for entry in entries.values():
    for _ in range(args.warmup):
      time_step(entry)
      time_prefill(entry)
  keys = list(entries)
  steps = {key: [] for key in keys}
  prefills = {key: [] for key in keys}
  rng = np.random.default_rng(0)
  for _ in range(args.steps):
    for index in rng.permutation(len(keys)):
      steps[keys[index]].append(time_step(entries[keys[index]]))
      prefills[keys[index]].append(time_prefill(entries[keys[index]]))

  tokens = args.batch * jax.device_count() * args.length
  print(
      f"\n{args.preset}, batch {args.batch} x length {args.length}, {args.steps} interleaved rounds, "
      f"jax {jax.__version__} on {jax.devices()[0].platform}; 'vs f32' = median of per-round ratios, same backend"
  )
  header = f"{'backend':<8}{'variant':<11}{'step ms':>9}{'vs f32':>8}{'prefill tok/s':>15}{'vs f32':>8}"
  print(header)
  print("-" * len(header))
  for backend, variant in keys:
    base = (backend, "f32")
    step_ratio = statistics.median(t / b for t, b in zip(steps[(backend, variant)], steps[base]))
    prefill_ratio = statistics.median(b / t for t, b in zip(prefills[(backend, variant)], prefills[base]))
    print(
        f"{backend:<8}{variant:<11}{statistics.median(steps[(backend, variant)]) * 1e3:>9.1f}{step_ratio:>8.2f}"
        f"{tokens / statistics.median(prefills[(backend, variant)]):>15.0f}{prefill_ratio:>8.2f}"
    )
  print("Serve-checkpoint bytes vs float: not measured (serve checkpoints are not built yet, issue 11 step 2).")


if __name__ == "__main__":
  main()
