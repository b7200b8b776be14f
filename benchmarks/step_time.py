"""Train-step time of the flag combinations, side by side in one process, as ratios to pure Linen.

    .venv/bin/python benchmarks/step_time.py [--steps 15] [--combos all|minimal] [--scan both|true|false]

The same as `maxbridge bench <preset> per_device_batch_size=4 max_target_length=128`;
how it times and what the columns mean: `maxbridge/training/bench.py`.

    .venv/bin/python benchmarks/step_time.py --devices 8 [--preset llama-tiny] [--steps 10]

instead times the meshes of MESHES on N virtual CPU devices (fsdp N, pipeline 2 x fsdp N/2, context 2 x
fsdp N/2), each on pure Linen and pure NNX, in one process and interleaved rounds, and prints the NNX/Linen
ratios side by side. A mesh whose config or trainer is refused prints "n/a (the reason)".
"""

import argparse
import os
import statistics

# --devices: fewer rounds and rows per device than one device's defaults, so 6 trainers on 2 cores take minutes.
DEVICES_STEPS = 30
DEVICES_BATCH = 2


def _mesh_overrides(devices: int) -> dict[str, list[str]]:
  half = devices // 2
  return {
      f"fsdp {devices}": [f"ici_fsdp_parallelism={devices}"],
      f"pipeline 2 x fsdp {half}": ["ici_pipeline_parallelism=2", f"ici_fsdp_parallelism={half}"],
      f"context 2 x fsdp {half}": ["ici_context_parallelism=2", f"ici_fsdp_parallelism={half}"],
  }


def mesh_step_time(preset: str, overrides: list[str], devices: int, steps: int, warmup: int) -> None:
  """Prints each mesh's Linen and NNX step time (median ms) and NNX/Linen ratios, timed in interleaved rounds."""
  import jax

  from maxbridge.core.config import load_config
  from maxbridge.models import dispatch
  from maxbridge.training import bench, data
  from maxbridge.training.loop import global_batch_size

  if jax.device_count() != devices:
    raise SystemExit(f"--devices {devices}: JAX sees {jax.device_count()} devices (was jax imported before?)")
  backends = ("linen", "nnx")
  meshes = _mesh_overrides(devices)
  # Refused: "n/a (reason)"; a config error or a trainer that refuses the mesh is the reason, nothing else.
  refused: dict[str, str] = {}
  timers, first_call_s, rows, cfg = {}, {}, None, None
  for mesh, mesh_keys in meshes.items():
    try:
      configs = {
          backend: load_config(
              preset,
              *overrides,
              *mesh_keys,
              **dispatch.backend_flags(backend),
              dataset_type="synthetic",
          )
          for backend in backends
      }
      rows = global_batch_size(configs["linen"])
      batches = data.make_dataset(configs["linen"], "train", rows)
      for backend in backends:
        trainer, state, first_call_s[mesh, backend] = bench.start(configs[backend], batches.batch(0))
        timers[mesh, backend] = _timer(bench, trainer, state, batches)
      cfg = configs["linen"]
    except (ValueError, NotImplementedError) as error:  # ConfigError is a ValueError
      refused[mesh] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
      for backend in backends:
        timers.pop((mesh, backend), None)

  times = bench.interleaved(timers, steps, warmup) if timers else {}
  print(
      f"jax {jax.__version__}, {devices} virtual {jax.devices()[0].platform} devices; {preset}"
      + (f", batch {rows} x length {cfg.max_target_length}" if cfg else "")
      + f"; {steps} timed rounds after {warmup} warm-up, each round every (mesh, backend) once in a random order"
  )
  print("NNX/Linen time = median of per-round ratios of step time (lower: NNX faster); speed = its inverse")
  header = (
      f"{'mesh':<22}{'Linen ms':>10}{'NNX ms':>10}{'NNX/Linen time':>16}{'NNX/Linen speed':>17}{'first call s L/N':>18}"
  )
  print(header)
  print("-" * len(header))
  for mesh in meshes:
    if mesh in refused:
      print(f"{mesh:<22}n/a ({refused[mesh]})")
      continue
    linen, nnx = times[mesh, "linen"], times[mesh, "nnx"]
    ratio = bench.median_ratio(nnx, linen)
    speed = statistics.median(b / t for t, b in zip(nnx, linen))
    first = f"{first_call_s[mesh, 'linen']:.1f}/{first_call_s[mesh, 'nnx']:.1f}"
    print(
        f"{mesh:<22}{statistics.median(linen) * 1e3:>10.1f}{statistics.median(nnx) * 1e3:>10.1f}"
        f"{ratio:>16.3f}{speed:>17.3f}{first:>18}"
    )


def _timer(bench, trainer, state, batches):
  """A no-argument callable timing one more step of `trainer` on the next batch, its state carried along."""
  carried = {"state": state, "step": 1}

  def seconds() -> float:
    carried["state"], elapsed = bench.timed_step(trainer, carried["state"], batches.batch(carried["step"]))
    carried["step"] += 1
    return elapsed

  return seconds


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default=None, help="default llama-small, or llama-tiny with --devices")
  parser.add_argument("--steps", type=int, default=None, help="timed rounds (default 15, or 30 with --devices)")
  parser.add_argument("--warmup", type=int, default=None, help="untimed steps after the first call (default 3)")
  parser.add_argument("--batch", type=int, default=None, help="rows per device (default 4, or 2 with --devices)")
  parser.add_argument("--length", type=int, default=128)
  parser.add_argument("--combos", choices=["all", "minimal"], default="all")
  parser.add_argument("--scan", choices=["both", "true", "false"], default="both")
  parser.add_argument(
      "--devices", type=int, default=0, help="time fsdp, pipeline x fsdp and context x fsdp on N virtual CPU devices"
  )
  args = parser.parse_args()
  if args.devices:
    if args.devices < 4 or args.devices % 4:
      parser.error(f"--devices must be a multiple of 4 (for 2 x fsdp N/2), got {args.devices}")
    # XLA reads this once, when JAX starts: before anything imports jax (bench does).
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
  from maxbridge.training import bench

  steps = args.steps if args.steps is not None else (DEVICES_STEPS if args.devices else bench.DEFAULT_STEPS)
  warmup = bench.DEFAULT_WARMUP if args.warmup is None else args.warmup
  batch = args.batch if args.batch is not None else (DEVICES_BATCH if args.devices else 4)
  if min(steps, batch, args.length) < 1 or warmup < 0:
    parser.error("--steps, --batch and --length must be >= 1, --warmup >= 0")
  overrides = [f"per_device_batch_size={batch}", f"max_target_length={args.length}"]
  if args.devices:
    mesh_step_time(args.preset or "llama-tiny", overrides, args.devices, steps, warmup)
  else:
    bench.step_time(
        args.preset or "llama-small", *overrides, steps=steps, warmup=warmup, combos=args.combos, scan=args.scan
    )


if __name__ == "__main__":
  main()
