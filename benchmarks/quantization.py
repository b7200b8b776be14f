"""Quantized (AQT int8, Qwix int8) vs float32: train-step time, prefill throughput and serve-checkpoint bytes.

    .venv/bin/python benchmarks/quantization.py [--preset llama-small] [--steps 10] [--batch 4] [--length 128]
    .venv/bin/python benchmarks/quantization.py --param-bytes gemma4-26b qwen3-30b-a3b ...

Every variant is timed in the same rounds, in a fresh random order each round
(as `maxbridge/training/bench.py` does), and reported as the median of per-round
ratios to float32 on the same backend. Prefill is one jitted forward pass
over a [batch, length] prompt (logits of every position), as tokens/s; the
"serve" variants prefill from frozen quantized weights (checkpoint_is_quantized)
and have no train step. Last, the float checkpoint is written and quantized
(`maxbridge quantize`) to each serve format, and the bytes on disk compared.
"""

import argparse
import functools
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

import maxbridge as mb
from maxbridge.training import bench
from maxbridge.core import canonical, checkpointing
from maxbridge.models import dispatch
from maxbridge.interop import quantize

VARIANTS = {
    "f32": {},
    "aqt int8": dict(quantization="int8"),
    "qwix int8": dict(quantization="int8", use_qwix_quantization=True),
    "aqt int8 serve": dict(quantization="int8", checkpoint_is_quantized=True),
    "qwix int8 serve": dict(quantization="int8", use_qwix_quantization=True, checkpoint_is_quantized=True),
}
# `maxbridge quantize` overrides of each serve checkpoint measured on disk.
SERVE_FORMATS = {
    "aqt int8": ["quantization=int8"],
    "qwix int8": ["quantization=int8", "use_qwix_quantization=true"],
    "qwix int4": ["quantization=int4", "use_qwix_quantization=true"],
    "qwix fp8": ["quantization=fp8", "use_qwix_quantization=true"],
}


def _bytes_on_disk(folder: Path) -> int:
  return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())


def serve_bytes(preset: str) -> None:
  """Writes the float checkpoint of `preset`, quantizes it to each serve format, prints bytes vs float."""
  config = mb.load_config(preset)
  with tempfile.TemporaryDirectory() as tmp:
    root = Path(tmp)
    checkpointer = checkpointing.Checkpointer(root / "f32")
    checkpointer.save(0, {"params": {"params": mb.create_model(config, seed=0).params()}})
    checkpointer.wait()
    checkpointer.close()
    config.to_yaml(root / "f32" / "config.yml")
    float_leaves = checkpointing.CheckpointReader(root / "f32").leaves
    float_disk = _bytes_on_disk(root / "f32")
    print(f"\nServe checkpoints of {preset} ({float_disk / 2**20:.1f} MiB float32 on disk)")
    header = f"{'format':<11}{'MiB on disk':>12}{'vs f32':>8}{'kernels vs f32':>16}"
    print(header)
    print("-" * len(header))
    for name, overrides in SERVE_FORMATS.items():
      quantize.quantize_checkpoint(root / "f32", root / name.replace(" ", "-"), *overrides)
      leaves = checkpointing.CheckpointReader(root / name.replace(" ", "-")).leaves
      kernels = [p for p in leaves if p.endswith("_qvalue")]  # dense kernels and routed experts
      quantized = sum(leaves[p].nbytes + leaves[p.removesuffix("_qvalue") + "_scale"].nbytes for p in kernels)
      floats = sum(float_leaves[p.removesuffix("_qvalue")].nbytes for p in kernels)
      disk = _bytes_on_disk(root / name.replace(" ", "-"))
      print(f"{name:<11}{disk / 2**20:>12.1f}{disk / float_disk:>8.3f}{quantized / floats:>16.3f}")
  print("('kernels vs f32': qvalues + scales of the quantized kernels over their float32 bytes, in memory, where")
  print(" jax holds int4 one value per byte; on disk orbax compresses, so int4 and fp8 take less. Embeddings and")
  print(" norms stay float32.)")


def param_bytes(presets: list[str]) -> None:
  """Parameter bytes of real-size presets, float32 against an AQT int8 serve checkpoint, from their abstract
  trees: nothing is allocated."""

  def gib(config) -> float:
    abstract = dispatch.abstract_model(config).abstract_params()
    return sum(leaf.size * leaf.dtype.itemsize for leaf in canonical.flatten(abstract).values()) / 2**30

  header = f"{'preset':<24}{'f32 GiB':>9}{'int8 serve GiB':>16}{'vs f32':>8}"
  print(header)
  print("-" * len(header))
  for preset in presets:
    config = mb.load_config(preset)
    full, served = gib(config), gib(config.replace(quantization="int8", checkpoint_is_quantized=True))
    print(f"{preset:<24}{full:>9.1f}{served:>16.1f}{served / full:>8.3f}")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument(
      "--param-bytes",
      nargs="+",
      metavar="PRESET",
      help="only the parameter bytes of these (real-size) presets, float32 vs an int8 serve checkpoint",
  )
  parser.add_argument("--preset", default="llama-small")
  parser.add_argument("--steps", type=int, default=10, help="timed rounds")
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--length", type=int, default=128)
  args = parser.parse_args()
  if args.param_bytes:
    param_bytes(args.param_bytes)
    return
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
      if cfg.checkpoint_is_quantized:  # serving: no train step; weights converted from the float model's
        trainer = state = compile_s = None
        float_params = entries[(backend, "f32")]["params"]
        model = mb.create_model(cfg, params=dispatch.quantize_params(cfg, float_params))
      else:
        trainer, state, compile_s = bench.start(cfg, batch)
        model = mb.create_model(cfg, seed=0)
      prompt = np.asarray(batch["inputs"])
      prefill = jax.jit(model.apply)
      params = model.params()
      prefill(params, prompt).block_until_ready()
      entries[(backend, variant)] = dict(
          trainer=trainer, state=state, batch=batch, compile_s=compile_s, prefill=prefill, params=params, prompt=prompt
      )
      print(f"built {backend} {variant}" + (f" (first step {compile_s:.1f} s)" if trainer else ""), flush=True)

  def time_step(entry):
    if entry["trainer"] is None:
      return float("nan")
    entry["state"], seconds = bench.timed_step(entry["trainer"], entry["state"], entry["batch"])
    return seconds

  def time_prefill(entry):
    start = time.perf_counter()
    entry["prefill"](entry["params"], entry["prompt"]).block_until_ready()
    return time.perf_counter() - start

  timers = {}
  for key, entry in entries.items():
    timers["step", key] = functools.partial(time_step, entry)
    timers["prefill", key] = functools.partial(time_prefill, entry)
  times = bench.interleaved(timers, args.steps, args.warmup)
  steps = {key: times["step", key] for key in entries}
  prefills = {key: times["prefill", key] for key in entries}

  tokens = args.batch * jax.device_count() * args.length
  print(
      f"\n{args.preset}, batch {args.batch} x length {args.length}, {args.steps} interleaved rounds, "
      f"jax {jax.__version__} on {jax.devices()[0].platform}; 'vs f32' = median of per-round ratios, same backend"
  )
  header = f"{'backend':<8}{'variant':<17}{'step ms':>9}{'vs f32':>8}{'prefill tok/s':>15}{'vs f32':>8}"
  print(header)
  print("-" * len(header))
  for backend, variant in entries:
    base = (backend, "f32")
    step_ratio = bench.median_ratio(steps[(backend, variant)], steps[base])
    prefill_ratio = bench.median_ratio(prefills[base], prefills[(backend, variant)])
    step = f"{statistics.median(steps[(backend, variant)]) * 1e3:>9.1f}{step_ratio:>8.2f}"
    if entries[(backend, variant)]["trainer"] is None:
      step = f"{'-':>9}{'-':>8}"
    print(
        f"{backend:<8}{variant:<17}{step}"
        f"{tokens / statistics.median(prefills[(backend, variant)]):>15.0f}{prefill_ratio:>8.2f}"
    )
  serve_bytes(args.preset)


if __name__ == "__main__":
  main()
