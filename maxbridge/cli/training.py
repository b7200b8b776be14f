"""`maxbridge train`, `shardings`, `compile`, `distill-logits` and `bench`: a run, and what to know before one."""

import argparse
import os

from maxbridge.cli.args import Verb, add_overrides, count
from maxbridge.core.config import ConfigError, load_config


def _add_train(verbs) -> None:
  p = verbs.add_parser("train", help="train a model from a preset or YAML file")
  p.add_argument("preset", help="preset name (e.g. llama-tiny) or path to a YAML config")
  add_overrides(p)


def _train(args: argparse.Namespace) -> int:
  config = load_config(args.preset, *args.overrides)  # a bad key fails here, before JAX starts
  # Each verb imports what it runs inside its handler: jax loads only for the verbs that need it, and after
  # the arguments and the config are checked.
  from maxbridge.training.loop import run_directory, train

  records = train(config)
  run_dir = run_directory(config)
  if records:
    print(f"{run_dir}: step {records[-1]['step']} loss {records[-1]['loss']:.4f}")
  else:
    print(f"{run_dir}: already trained to step {config.steps}; nothing to do")
  return 0


TRAIN = Verb("train", _add_train, _train)


def _add_plan(verbs, verb: str, text: str) -> None:
  p = verbs.add_parser(verb, help=text)
  p.add_argument("preset", help="preset name (e.g. llama2-7b) or path to a YAML config")
  p.add_argument(
      "--devices",
      type=count,
      default=0,
      help="devices the mesh spans (compile: virtual CPU devices stand in; shardings: shapes only, none needed)",
  )
  add_overrides(p)


def _add_shardings(verbs) -> None:
  _add_plan(
      verbs, "shardings", "print each parameter's and optimizer state's logical axes, PartitionSpec and bytes per device"
  )


def _add_compile(verbs) -> None:
  _add_plan(verbs, "compile", "compile the train step ahead of time on abstract arrays; print memory and FLOPs")


def _virtual_devices(args: argparse.Namespace) -> None:
  # XLA reads this once, when JAX starts: before anything imports jax.
  if args.devices:
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def _one_target(config, args: argparse.Namespace) -> None:
  if config.compile_topology and args.devices:
    raise ConfigError(f"--devices={args.devices} and compile_topology={config.compile_topology}: name one")


def _devices(config, args: argparse.Namespace) -> int:
  """The devices a plan is for: compile_topology's chips, --devices, or this host's."""
  _one_target(config, args)
  if config.compile_topology:
    from maxbridge.training import topology

    return topology.target(config).chips
  import jax

  return args.devices or jax.device_count()


def _shardings(args: argparse.Namespace) -> int:
  config = load_config(args.preset, *args.overrides)
  from maxbridge.training import aot

  # The plan needs shapes only: --devices or compile_topology sizes an abstract mesh, no devices.
  print(aot.sharding_table(config, _devices(config, args)))
  return 0


def _compile(args: argparse.Namespace) -> int:
  config = load_config(args.preset, *args.overrides)
  _one_target(config, args)
  _virtual_devices(args)
  from maxbridge.core import pipeline_plan
  from maxbridge.ops import pipeline
  from maxbridge.training import aot, topology

  target = topology.target(config) if config.compile_topology else None
  try:
    result = aot.compile_train_step(config)
  except Exception as e:
    if target is None or (sizes := topology.out_of_memory(e)) is None:
      raise
    needed, available = sizes
    print(
        f"does not fit: the train step of {config.model_name} on {target.name} needs {needed / 2**30:.2f} GiB of HBM "
        f"per chip, {available / 2**30:.2f} GiB available ({(needed - available) / 2**30:.2f} GiB over). "
        f"The TPU compiler: {str(e).splitlines()[0]}"
    )
    return 1
  gib = 2**30
  mesh = " x ".join(f"{k}={v}" for k, v in result["mesh"].items())
  where = (
      f"{target.name} ({result['devices']} chips, {result['device_kind']})" if target else f"{result['devices']} devices"
  )
  print(f"compiled the train step of {config.model_name} for {where} ({mesh})")
  print(f"  parameters + optimizer state: {result['state_bytes'] / gib:8.2f} GiB per device")
  print(f"  arguments:                    {result['argument_bytes'] / gib:8.2f} GiB per device")
  print(f"  temporaries:                  {result['temp_bytes'] / gib:8.2f} GiB per device")
  print(f"  outputs (aliased to inputs):  {result['output_bytes'] / gib:8.2f} GiB per device")
  print(f"  peak:                         {result['peak_bytes'] / gib:8.2f} GiB per device")
  if result["host_bytes"]:
    print(f"  host memory (offloaded):      {result['host_bytes'] / gib:8.2f} GiB per device")
  print(f"  model FLOPs per step:         {result['model_flops']:8.3e} (6 N tokens + attention, all devices)")
  print(f"  XLA cost analysis FLOPs:      {result['flops']:8.3e} per device (a scanned layer counts once)")
  print(f"  XLA cost analysis bytes:      {result['bytes_accessed']:8.3e} accessed per device")
  if target:
    seconds = topology.roofline_seconds(target, result["model_flops"] / result["devices"], result["bytes_accessed"])
    print(
        f"  roofline step time:           {seconds:8.3f} s ({target.chip.bf16_tflops:.0f} TFLOP/s bf16, "
        f"{target.chip.hbm_gbps:.0f} GB/s HBM, {target.chip.hbm_gib:.0f} GiB HBM per chip)"
    )
  if plan := pipeline_plan.pipeline_plan(config):
    bubble = pipeline.bubble_fraction(plan.stages, plan.microbatches, plan.repeats)
    print(
        f"  pipeline: {plan.stages} stages x {plan.repeats} repeats x {plan.per_stage} layers of {plan.stack!r}, "
        f"{plan.microbatches} micro-batches; bubble {bubble:.1%}"
    )
  return 0


SHARDINGS = Verb("shardings", _add_shardings, _shardings)
COMPILE = Verb("compile", _add_compile, _compile)


def _add_distill_logits(verbs) -> None:
  p = verbs.add_parser(
      "distill-logits",
      help="write a distillation teacher's top-k logits of a run's training batches, for distill_logits_path",
  )
  p.add_argument("preset", help="the student run's folder, preset or YAML config (with its teacher_overrides)")
  p.add_argument("destination", help="new folder for the logits")
  p.add_argument("--top-k", type=count, required=True, help="logits kept per token (the vocabulary size: all)")
  p.add_argument("--steps", type=count, default=0, help="training batches to cover (default: the config's steps)")
  add_overrides(p)


def _distill_logits(args: argparse.Namespace) -> int:
  preset = os.path.join(args.preset, "config.yml") if os.path.isdir(args.preset) else args.preset
  config = load_config(preset, *args.overrides)
  from maxbridge.training import distill, hooks

  steps = args.steps or config.steps
  out = distill.write_logits(
      config, args.destination, top_k=args.top_k, steps=steps, rows=hooks.global_batch_size(config)
  )
  print(f"wrote the teacher's top-{args.top_k} logits of {steps} training batches to {out}")
  print(f"train on them with distill_logits_path={out}")
  return 0


DISTILL_LOGITS = Verb("distill-logits", _add_distill_logits, _distill_logits)


def _add_bench(verbs) -> None:
  p = verbs.add_parser(
      "bench",
      help="time the train step of Linen, NNX and mixed backends side by side",
      description="Times one train step of each flag combination per round, interleaved, and prints "
      "step and compile time as ratios to pure Linen (benchmarks/step_time.py runs the same).",
  )
  p.add_argument("preset", help="preset name or path to a YAML config")
  p.add_argument("--steps", type=int, default=15, help="timed rounds, one step per combination (default 15)")
  p.add_argument("--warmup", type=int, default=3, help="untimed steps after the first call (default 3)")
  p.add_argument("--combos", choices=["all", "minimal"], default="all", help="all 8, or the pure ends and two flips")
  p.add_argument("--scan", choices=["both", "true", "false"], default="both", help="scan_layers settings to time")
  add_overrides(p)


def _bench(args: argparse.Namespace) -> int:
  load_config(args.preset, *args.overrides)  # a bad key fails here, before JAX starts
  from maxbridge.training import bench

  bench.step_time(args.preset, *args.overrides, steps=args.steps, warmup=args.warmup, combos=args.combos, scan=args.scan)
  return 0


BENCH = Verb("bench", _add_bench, _bench)
