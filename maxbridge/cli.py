"""The `maxbridge` command: one verb per workflow, configuration as key=value.

Exit status: 0 done; 2 bad input (a file, key, path or shape the message
names, which the user can fix); 1 an internal failure, or a run that diverged;
128 + N a signal N (SIGINT, SIGTERM). Errors print one message, no traceback,
unless `--debug` is given or MAXBRIDGE_DEBUG=1 is set.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Sequence

from maxbridge.core.config import load_config

Handler = Callable[[argparse.Namespace], int]

BAD_INPUT = 2
INTERNAL = 1
DEBUG_ENV = "MAXBRIDGE_DEBUG"
# Seconds a finished command waits for threads a library left running before it exits anyway.
EXIT_GRACE_S = 5.0


def _train(args: argparse.Namespace) -> int:
  config = load_config(args.preset, *args.overrides)  # a bad key fails here, before JAX starts
  # Each verb imports what it runs, here and below: jax loads only for the verbs that need it, and after
  # the arguments and the config are checked.
  from maxbridge.training.loop import run_directory, train

  records = train(config)
  run_dir = run_directory(config)
  if records:
    print(f"{run_dir}: step {records[-1]['step']} loss {records[-1]['loss']:.4f}")
  else:
    print(f"{run_dir}: already trained to step {config.steps}; nothing to do")
  return 0


def _convert(args: argparse.Namespace) -> int:
  import converters  # jax and orbax load only for the verbs that need them

  conversion = converters.convert(
      args.source,
      args.destination,
      layout=args.layout,
      scan_layers=args.scan_layers,
      param_scan_axis=args.param_scan_axis,
      dtype=args.dtype,
      params_only=args.params_only,
      force=args.force,
      config=args.config,
  )
  print(conversion.summary())
  return 0


def _compare(args: argparse.Namespace) -> int:
  import converters

  comparison = converters.compare(
      args.first,
      args.second,
      atol=args.atol,
      rtol=args.rtol,
      params_only=args.params_only,
      metadata_only=args.metadata_only,
  )
  print(comparison.report())
  return 0 if comparison.equal else 1


def _verify(args: argparse.Namespace) -> int:
  import converters

  checks = converters.verify(args.path)
  for check in checks:
    print(check.line())
  damaged = [c for c in checks if not c.ok]
  if not damaged:
    return 0
  good = [c for c in checks if c.ok]
  intact = f"; the latest step that verified is {good[-1].where}" if good else ""
  print(f"maxbridge verify: {len(damaged)} of {len(checks)} checkpoint(s) damaged{intact}", file=sys.stderr)
  return BAD_INPUT  # as a damaged checkpoint is for every other verb


def _count(text: str) -> int:
  """A whole number >= 0 (argparse's int() also takes "-2")."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
  if value < 0:
    raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
  return value


def _tolerance(text: str) -> float:
  """A finite float >= 0 (float() also takes "nan", "-1" and "inf")."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
  if not (math.isfinite(value) and value >= 0):
    raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
  return value


def _bool(text: str) -> bool:
  words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
  if text.strip().lower() not in words:
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
  return words[text.strip().lower()]


def _import_hf(args: argparse.Namespace) -> int:
  from maxbridge.interop import hf

  out = hf.import_hf(args.source, args.destination, *args.overrides, scan_layers=args.scan_layers, dtype=args.dtype)
  print(f"{out}: params-only checkpoint at step 0, with config.yml")
  return 0


def _lora_merge(args: argparse.Namespace) -> int:
  from maxbridge.interop import lora_merge

  out = lora_merge.merge_checkpoint(args.base, args.adapters, args.destination)
  print(f"{out}: params-only checkpoint at step {_step(out)} (base + adapters), with config.yml")
  return 0


def _export_hf(args: argparse.Namespace) -> int:
  from maxbridge.interop import pretrained

  out = pretrained.export_hf(args.source, args.destination, dtype=args.dtype, config=args.config)
  print(f"{out}: config.json + model.safetensors")
  return 0


def _quantize(args: argparse.Namespace) -> int:
  from maxbridge.interop import quantize

  out = quantize.quantize_checkpoint(args.source, args.destination, *args.overrides, config=args.config)
  print(
      f"{out}: serve checkpoint (quantized values and scales in place of float kernels) at step {_step(out)}, with config.yml"
  )
  return 0


def _step(checkpoints) -> int:
  from maxbridge.core import checkpointing

  return checkpointing.resolve(checkpoints)[1]


def _load_model(args: argparse.Namespace):
  """The model `generate` and `serve` run: SOURCE's checkpoint or Hugging Face folder, or a preset's."""
  from pathlib import Path

  from maxbridge.core import checkpointing
  from maxbridge.interop import pretrained
  from maxbridge.models import dispatch

  flags = pretrained.backend_overrides(args.backend)
  if Path(args.source).is_dir():
    config, params = pretrained.load_pretrained(args.source, *args.overrides, config=args.config, **flags)
    return dispatch.create_model(config, params=params)
  # A preset or YAML file: MaxText's load_parameters_path, else a random model for smoke tests.
  config = load_config(args.source, *args.overrides, **flags)
  path = config.load_parameters_path or config.load_full_state_path
  return dispatch.create_model(config, params=checkpointing.load_params(path)[0] if path else None)


def _generate(args: argparse.Namespace) -> int:
  model = _load_model(args)
  encode, decode = _tokenizer(args.source, model.config.vocab_size)
  prompt = encode(args.prompt)
  if not prompt:
    raise ValueError("--prompt is empty: give at least one token to continue")
  new_tokens = args.max_new_tokens
  if new_tokens is None:  # as many as fit in the trained length, up to 32: a default call never warns past it
    new_tokens = min(32, max(1, model.config.max_target_length - len(prompt)))
  from maxbridge.serving import engine

  # The engine's own sampling: the decode_sampling_* keys, which --temperature and --seed set when given.
  config = model.config
  if args.temperature == 0:
    config = config.replace(decode_sampling_strategy="greedy")
  elif args.temperature is not None:
    strategy = "weighted" if config.decode_sampling_strategy == "greedy" else config.decode_sampling_strategy
    config = config.replace(decode_sampling_strategy=strategy, decode_sampling_temperature=args.temperature)
  if args.seed is not None:
    config = config.replace(seed=args.seed)  # the parameters are made already: this seeds sampling alone
  continuation = engine.generate_continuation(config, model, prompt, new_tokens)
  print(decode([*prompt, *(int(t) for t in continuation)]))
  return 0


def _tokenizer(source: str, vocab_size: int):
  """(encode, decode): tokenizer.json through `tokenizers` when the source has one, else bytes."""
  from maxbridge.interop import pretrained

  folder = pretrained.tokenizer_folder(source)
  if folder is not None:
    try:
      import tokenizers  # noqa: F401  (whether it is installed: load_tokenizer reads with it)
    except ImportError:
      print(
          f"maxbridge generate: {folder}/tokenizer.json found but the tokenizers package is "
          "missing; using byte-level tokens",
          file=sys.stderr,
      )
    else:
      tokenizer = pretrained.load_tokenizer(folder, vocab_size)
      return (
          lambda text: tokenizer.encode(text).ids,
          lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
      )
  if vocab_size < 256:
    raise ValueError(f"no tokenizer.json in {source} and vocab_size={vocab_size} is too small for byte tokens")
  return (
      lambda text: list(text.encode("utf-8")),
      lambda ids: bytes(t for t in ids if t < 256).decode("utf-8", errors="replace"),
  )


def _serve(args: argparse.Namespace) -> int:
  from pathlib import Path

  from maxbridge.interop import pretrained
  from maxbridge.serving import engine, server

  model = _load_model(args)
  encode, decode = _tokenizer(args.source, model.config.vocab_size)
  codec = server.Codec.from_folder(encode, decode, pretrained.tokenizer_folder(args.source) or Path(args.source))
  serving = engine.Engine(model.config, model=model)
  print(
      f"maxbridge serve: {args.source} on http://{args.host}:{args.port}/v1 ({serving.max_concurrent_decodes} slots)",
      flush=True,
  )
  server.serve(
      serving,
      codec,
      host=args.host,
      port=args.port,
      model_name=args.model_name or Path(args.source).name,
      max_queue=args.max_queue,
      shutdown_timeout=args.shutdown_timeout,
  )
  return 0


def _virtual_devices(args: argparse.Namespace) -> None:
  # XLA reads this once, when JAX starts: before anything imports jax.
  if args.devices:
    flag = f"--xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()


def _shardings(args: argparse.Namespace) -> int:
  config = load_config(args.preset, *args.overrides)
  import jax

  from maxbridge.training import aot

  # The plan needs shapes only: --devices sizes an abstract mesh, no virtual devices.
  print(aot.sharding_table(config, args.devices or jax.device_count()))
  return 0


def _compile(args: argparse.Namespace) -> int:
  config = load_config(args.preset, *args.overrides)
  _virtual_devices(args)
  from maxbridge.core import families
  from maxbridge.ops import pipeline
  from maxbridge.training import aot

  result = aot.compile_train_step(config)
  gib = 2**30
  mesh = " x ".join(f"{k}={v}" for k, v in result["mesh"].items())
  print(f"compiled the train step of {config.model_name} for {result['devices']} devices ({mesh})")
  print(f"  parameters + optimizer state: {result['state_bytes'] / gib:8.2f} GiB per device")
  print(f"  arguments:                    {result['argument_bytes'] / gib:8.2f} GiB per device")
  print(f"  temporaries:                  {result['temp_bytes'] / gib:8.2f} GiB per device")
  print(f"  outputs (aliased to inputs):  {result['output_bytes'] / gib:8.2f} GiB per device")
  print(f"  model FLOPs per step:         {result['model_flops']:8.3e} (6 N tokens + attention, all devices)")
  print(f"  XLA cost analysis FLOPs:      {result['flops']:8.3e} per device (a scanned layer counts once)")
  if plan := families.pipeline_plan(config):
    bubble = pipeline.bubble_fraction(plan.stages, plan.microbatches, plan.repeats)
    print(
        f"  pipeline: {plan.stages} stages x {plan.repeats} repeats x {plan.per_stage} layers of {plan.stack!r}, "
        f"{plan.microbatches} micro-batches; bubble {bubble:.1%}"
    )
  return 0


def _migrate(args: argparse.Namespace) -> int:
  import yaml

  linen_kwargs = {}
  for item in args.linen_arg:
    key, sep, value = item.partition("=")
    if not sep or not key.isidentifier():
      raise ValueError(f"--linen-arg {item!r}: expected name=value, e.g. train=false")
    linen_kwargs[key] = yaml.safe_load(value)
  from maxbridge.migrate import checkpoint

  shape = checkpoint.parse_shape(args.input_shape) if args.input_shape else None
  if args.action == "check":
    if shape is None:
      raise ValueError("migrate check needs --input-shape, e.g. --input-shape 2,28,28,1")
    plan, comparison = checkpoint.check(
        args.linen, args.nnx, shape, rules=args.rules, linen_kwargs=linen_kwargs, atol=args.atol
    )
    print(plan)
    print(comparison)
    return 0 if comparison.ok else 1
  plan = checkpoint.convert_checkpoint(
      args.source, args.destination, args.linen, args.nnx, rules=args.rules, input_shape=shape, linen_kwargs=linen_kwargs
  )
  print(f"{args.destination}: {plan.__str__().splitlines()[0].removeprefix('migrate plan: ')}")
  return 0


def _data(args: argparse.Namespace) -> int:
  from maxbridge.training import grain_data  # grain (and jax) load only for this verb

  if args.action == "inspect":
    config = load_config(args.preset, *args.overrides)
    if config.dataset_type != "grain":
      raise ValueError(f"data inspect reads dataset_type=grain configs, got dataset_type={config.dataset_type!r}")
    print(grain_data.inspect(config, batches=args.batches))
  else:
    written = grain_data.convert(args.source, args.destination, progress=sys.stderr.isatty())
    print(
        f"{args.destination}: {len(written)} ArrayRecord file(s); train on them with dataset_type=grain "
        f"grain_train_files={args.destination}"
    )
  return 0


def _bench(args: argparse.Namespace) -> int:
  load_config(args.preset, *args.overrides)  # a bad key fails here, before JAX starts
  from maxbridge.training import bench

  bench.step_time(args.preset, *args.overrides, steps=args.steps, warmup=args.warmup, combos=args.combos, scan=args.scan)
  return 0


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


HANDLERS: dict[str, Handler] = {
    "shardings": _shardings,
    "compile": _compile,
    "distill-logits": _distill_logits,
    "train": _train,
    "convert": _convert,
    "compare": _compare,
    "verify": _verify,
    "import-hf": _import_hf,
    "export-hf": _export_hf,
    "quantize": _quantize,
    "lora-merge": _lora_merge,
    "generate": _generate,
    "serve": _serve,
    "bench": _bench,
    "migrate": _migrate,
    "data": _data,
}


_CONFIG_HELP = "preset or YAML file describing a checkpoint that has no config.yml (MaxText's)"


def _overrides(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. steps=20 pure_nnx=true")


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="maxbridge",
      description="One transformer in Flax Linen and NNX. Configuration is key=value, as in MaxText. "
      "Exit 0 done, 2 bad input (one line names it), 1 internal failure.",
  )
  debug = f"show the traceback of an error (or set {DEBUG_ENV}=1)"
  parser.add_argument("--debug", action="store_true", help=debug)
  verbs = parser.add_subparsers(dest="verb", required=True, metavar="COMMAND")

  p = verbs.add_parser("train", help="train a model from a preset or YAML file")
  p.add_argument("preset", help="preset name (e.g. llama-tiny) or path to a YAML config")
  _overrides(p)

  p = verbs.add_parser(
      "convert",
      help="convert a checkpoint between layouts (linen, nnx), scanned and unscanned, dtypes",
      description="Converts a checkpoint array by array into DESTINATION/<step>/items; "
      "the source's layout is detected. Exit 0 done, 2 error (nothing written).",
  )
  p.add_argument("source", help="run, checkpoints, step or items directory (the latest step is read)")
  p.add_argument("destination", help="checkpoints directory to create (e.g. runs/new/checkpoints)")
  p.add_argument("--layout", choices=["linen", "nnx"], help="on-disk layout to write (default: the source's)")
  p.add_argument(
      "--scan-layers", type=_bool, metavar="{true,false}", help="stack or unstack the layers (default: as the source)"
  )
  p.add_argument(
      "--param-scan-axis",
      type=int,
      choices=(0, 1),
      metavar="N",
      help="layer axis to stack or unstack on (default: the source config's, else 1)",
  )
  p.add_argument("--dtype", choices=["float32", "bfloat16"], help="cast floating-point arrays, optimizer state included")
  p.add_argument("--params-only", action="store_true", help="drop optimizer state and step (a decode checkpoint)")
  p.add_argument("--force", action="store_true", help="replace DESTINATION if it exists")
  p.add_argument("--config", help=_CONFIG_HELP + "; written with the result")

  p = verbs.add_parser(
      "compare",
      help="compare two checkpoints in any layouts",
      description="Normalises both checkpoints (layout, leaf wrappers, scanned vs unscanned) and "
      "compares structure, shapes, dtypes and values. Exit 0 equal, 1 different, 2 error.",
  )
  p.add_argument("first", help="run, checkpoints, step or items directory")
  p.add_argument("second", help="run, checkpoints, step or items directory")
  p.add_argument("--atol", type=_tolerance, default=0.0, help="absolute tolerance (default 0)")
  p.add_argument("--rtol", type=_tolerance, default=0.0, help="relative tolerance (default 0)")
  p.add_argument("--params-only", action="store_true", help="compare parameters only")
  p.add_argument("--metadata-only", action="store_true", help="compare structure, shapes and dtypes, reading no data")

  p = verbs.add_parser(
      "verify",
      help="check every array of a checkpoint, or of every step of a run, against its saved digest",
      description="Reads every array (no model is built) and compares it with the digest recorded when it was "
      "saved; prints one line per step. Exit 0 all clean, 2 any step damaged (or a bad path).",
  )
  p.add_argument("path", help="run, checkpoints (every step), step or items directory (that step)")

  p = verbs.add_parser(
      "import-hf",
      help="import a Hugging Face checkpoint folder",
      description="Reads config.json + model.safetensors (or a sharded index) of a llama, mistral, "
      "qwen3, gpt2, mixtral or deepseek_v3 model and writes a params-only maxbridge checkpoint "
      "(DESTINATION/0/items, config.yml). Exit 0 done, 2 error (nothing written).",
  )
  p.add_argument("source", help="Hugging Face model folder")
  p.add_argument("destination", help="new directory to write the maxbridge checkpoint to")
  p.add_argument(
      "--scan-layers",
      type=_bool,
      metavar="{true,false}",
      help="store the layers stacked (default: base.yml's scan_layers)",
  )
  p.add_argument("--dtype", choices=["float32", "bfloat16"], help="parameter dtype to store (default float32)")
  _overrides(p)

  p = verbs.add_parser(
      "export-hf",
      help="export a checkpoint as a Hugging Face folder",
      description="Writes DESTINATION/config.json + model.safetensors, which transformers loads. "
      "Exit 0 done, 2 error (nothing written).",
  )
  p.add_argument("source", help="checkpoint or run directory (with its config.yml)")
  p.add_argument("destination", help="new Hugging Face folder to write")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], help="tensor dtype (default: the checkpoint's)")
  p.add_argument("--config", help=_CONFIG_HELP)

  p = verbs.add_parser(
      "quantize",
      help="make a serve checkpoint (frozen int8 weights) from a float checkpoint",
      description="Reads a float checkpoint (maxbridge, MaxText with --config, an imported or raw Hugging Face "
      "folder, or a preset/YAML whose load_parameters_path names one) and writes DESTINATION/0/items + "
      "config.yml with checkpoint_is_quantized=true: every quantized kernel as kernel_qvalue + kernel_scale. "
      "Needs quantization=int8 (AQT), or use_qwix_quantization=true with quantization=int8, int4 or fp8 (Qwix "
      "PTQ). Exit 0 done, 2 error (nothing written).",
  )
  p.add_argument("source", help="checkpoint, run or Hugging Face folder; or a preset/YAML with load_parameters_path")
  p.add_argument("destination", help="new directory to write the serve checkpoint to")
  p.add_argument("--config", help=_CONFIG_HELP)
  _overrides(p)

  p = verbs.add_parser(
      "lora-merge",
      help="merge a LoRA run's adapters into its base: a plain checkpoint",
      description="Writes BASE + lora_alpha/lora_rank * A @ B (DESTINATION/0/items, config.yml), which "
      "export-hf, generate and train read like any checkpoint. BASE must be the base the adapters were "
      "trained on (its fingerprint is checked). Exit 0 done, 2 error (nothing written).",
  )
  p.add_argument("base", help="Hugging Face folder or checkpoint the adapters were trained on")
  p.add_argument("adapters", help="the LoRA run, its checkpoints or a step directory (the latest step is read)")
  p.add_argument("destination", help="new directory to write the merged checkpoint to")

  p = verbs.add_parser(
      "generate",
      help="generate text from a checkpoint, Hugging Face folder or preset",
      description="Samples as mb.Engine does, by the decode_sampling_* keys (greedy by default). Uses SOURCE's "
      "tokenizer.json (via the tokenizers package) when there is one, else UTF-8 bytes as tokens. A preset gives a randomly initialised model.",
  )
  p.add_argument("source", help="Hugging Face folder, checkpoint or run directory, preset or YAML config")
  p.add_argument("--prompt", default="", help="text to continue")
  p.add_argument(
      "--max-new-tokens",
      type=_count,
      default=None,
      help="tokens to generate (default 32, or fewer where the prompt and 32 would pass max_target_length)",
  )
  p.add_argument(
      "--temperature",
      type=_tolerance,
      default=None,
      help="0 decodes greedily; T > 0 sets decode_sampling_temperature=T and samples (weighted, unless "
      "decode_sampling_strategy is topk or nucleus). Default: the decode_sampling_* keys as they are",
  )
  p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the config's seed)")
  p.add_argument(
      "--backend",
      choices=["linen", "nnx"],
      default=None,
      help="model backend (default: the checkpoint's config.yml, else NNX as base.yml sets it)",
  )
  p.add_argument("--config", help=_CONFIG_HELP)
  _overrides(p)

  p = verbs.add_parser(
      "serve",
      help="serve a checkpoint, Hugging Face folder or preset over an OpenAI-compatible HTTP API",
      description="POST /v1/completions and /v1/chat/completions (streamed or whole), GET /v1/models, /health, "
      "/metrics. Continuous batching over per_device_batch_size slots per device; prompts up to "
      "max_prefill_predict_length, prompt and completion up to max_target_length. SIGTERM drains and exits 0.",
  )
  p.add_argument("source", help="Hugging Face folder, checkpoint or run directory, preset or YAML config")
  p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
  p.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
  p.add_argument("--model-name", default=None, help="the model's name in the API (default: SOURCE's last part)")
  p.add_argument("--max-queue", type=_count, default=64, help="requests waiting for a slot before 429 (default 64)")
  p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds SIGTERM lets requests finish (default 30)")
  p.add_argument("--backend", choices=["linen", "nnx"], default=None, help="model backend (as for generate)")
  p.add_argument("--config", help=_CONFIG_HELP)
  _overrides(p)

  for verb, text in (
      ("shardings", "print each parameter's and optimizer state's logical axes, PartitionSpec and bytes per device"),
      ("compile", "compile the train step ahead of time on abstract arrays; print memory and FLOPs"),
  ):
    p = verbs.add_parser(verb, help=text)
    p.add_argument("preset", help="preset name (e.g. llama2-7b) or path to a YAML config")
    p.add_argument(
        "--devices",
        type=_count,
        default=0,
        help="devices the mesh spans (compile: virtual CPU devices stand in; shardings: shapes only, none needed)",
    )
    _overrides(p)

  p = verbs.add_parser(
      "distill-logits",
      help="write a distillation teacher's top-k logits of a run's training batches, for distill_logits_path",
  )
  p.add_argument("preset", help="the student run's folder, preset or YAML config (with its teacher_overrides)")
  p.add_argument("destination", help="new folder for the logits")
  p.add_argument("--top-k", type=_count, required=True, help="logits kept per token (the vocabulary size: all)")
  p.add_argument("--steps", type=_count, default=0, help="training batches to cover (default: the config's steps)")
  _overrides(p)

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
  _overrides(p)

  p = verbs.add_parser(
      "migrate",
      help="move your own Flax Linen model and its checkpoints to its NNX twin (docs/migrate.md)",
      description="check: match a Linen module's variables to its NNX twin, convert them, and compare outputs and "
      "gradients, naming the first submodule that differs (exit 0 agree, 1 differ, 2 error). convert: turn a "
      "Linen orbax checkpoint (TrainState or variables) into one the NNX twin restores (exit 0 done, 2 error, "
      "nothing written).",
  )
  actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
  for action, text in (("check", "compare the two modules layer by layer"), ("convert", "convert a checkpoint")):
    a = actions.add_parser(action, help=text)
    if action == "convert":
      a.add_argument("source", help="Linen orbax checkpoint (item, step or CheckpointManager directory)")
      a.add_argument("destination", help="new directory for the NNX checkpoint (never overwritten)")
    a.add_argument(
        "--linen",
        required=True,
        metavar="MOD:FN",
        help="pkg.module:function or file.py:function returning the Linen module",
    )
    a.add_argument(
        "--nnx",
        required=True,
        metavar="MOD:FN",
        help="function returning the NNX module, or (module, nnx.Optimizer) to convert the optimizer state too",
    )
    a.add_argument("--rules", help="YAML file of extra rules: rules: [{linen: REGEX, nnx: PATH, transpose: [1, 0]}]")
    a.add_argument(
        "--input-shape",
        required=action == "check",
        metavar="N,N,..",
        help="shape of a float input" + (" (checks the checkpoint against the module)" if action == "convert" else ""),
    )
    a.add_argument(
        "--linen-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="keyword argument of the Linen module's call, e.g. train=false (repeatable)",
    )
    if action == "check":
      a.add_argument("--atol", type=_tolerance, default=1e-6, help="absolute tolerance (default 1e-6)")
    a.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug)

  p = verbs.add_parser(
      "data",
      help="look at a Grain corpus as the run reads it, or convert one to ArrayRecord",
      description="inspect: a dataset_type=grain config's documents, tokens, padding and a few decoded rows. "
      "convert: JSONL, Parquet or text files (a file, folder or glob) to a new folder of ArrayRecord files, "
      "one per source file, with progress (exit 0 done, 2 bad input, nothing written).",
  )
  actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
  a = actions.add_parser("inspect", help="decoded rows, token count and padding of a grain config")
  a.add_argument("preset", help="preset name or YAML config with dataset_type=grain")
  a.add_argument("--batches", type=_count, default=2, help="batches to read (default 2)")
  _overrides(a)
  a.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug)
  a = actions.add_parser("convert", help="write ArrayRecord from JSONL, Parquet or text")
  a.add_argument("source", help="JSONL, Parquet or .txt file, folder or glob")
  a.add_argument("destination", help="new folder for the .arrayrecord files (never overwritten)")
  a.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug)

  for sub in verbs.choices.values():
    # After the verb too; SUPPRESS keeps the subparser from resetting `maxbridge --debug VERB`.
    sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=debug)
  return parser


_OVERRIDE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*=")


def _is_override(text: str) -> bool:
  return bool(_OVERRIDE.match(text)) and not os.path.exists(text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """argparse, except that key=value overrides may come anywhere: before, between or after options."""
  parser = build_parser()
  args, extras = parser.parse_known_args(argv)
  if not hasattr(args, "overrides"):
    return parser.parse_args(argv)  # no overrides here: argparse names anything unknown
  if any(x.startswith("-") for x in extras):
    parser.parse_args(argv)  # exits 2, naming the option it does not know
  # A key=value before the preset or paths takes their place in argparse's eyes: sort them out.
  names = [name for name in ("preset", "source", "destination") if hasattr(args, name)]
  given = [getattr(args, name) for name in names] + list(args.overrides) + list(extras)
  positional = [x for x in given if not _is_override(x)]
  named = [x.partition("=")[2] for x in given if _is_override(x) and x.startswith("model_name=")]
  if names[:1] == ["preset"] and not positional and named:
    positional = named[-1:]  # MaxText's model_name=<preset> in place of the preset
  if len(positional) < len(names):
    parser.error(f"the following arguments are required: {', '.join(names[len(positional):])}")
  if len(positional) > len(names):
    parser.error(f"unexpected argument(s) {positional[len(names):]}; config overrides are key=value")
  for name, value in zip(names, positional):
    setattr(args, name, value)
  args.overrides = [x for x in given if _is_override(x)]
  return args


def _is_bad_input(error: BaseException) -> bool:
  # Our errors (ConfigError, CheckpointError, ConversionError, HFError) are ValueErrors;
  # OSError covers a missing file, a full disk, a read-only folder.
  return isinstance(error, (ValueError, OSError, NotImplementedError))


def _report(verb: str, error: BaseException, debug: bool) -> int:
  """Prints `error` for a person: one message, the traceback only when asked for; the exit status."""
  if debug:
    traceback.print_exception(error)
  message = str(error)
  notes = "".join(f"\n  {note}" for note in getattr(error, "__notes__", ()))
  if isinstance(error, KeyboardInterrupt):
    print(f"maxbridge {verb}: {message or 'interrupted'}{notes}", file=sys.stderr)
    return 128 + getattr(error, "signum", 2)
  if _is_bad_input(error):
    print(f"maxbridge {verb}: {message}{notes}", file=sys.stderr)
    return BAD_INPUT
  hint = "" if debug else f" (run with --debug or {DEBUG_ENV}=1 for the traceback)"
  if isinstance(error, ArithmeticError):  # a run that diverged says all there is to say
    print(f"maxbridge {verb}: {message}{notes}", file=sys.stderr)
  else:
    print(f"maxbridge {verb}: internal error: {type(error).__name__}: {message}{notes}{hint}", file=sys.stderr)
  return INTERNAL


def main(argv: Sequence[str] | None = None) -> int:
  """Runs one command; returns its exit status. Called with no `argv` it is the process's
  entry point, and also makes sure the process ends (see `_exit_promptly`)."""
  args = parse_args(argv)
  debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
  if argv is None and not debug:
    _quiet_library_tracebacks()
  try:
    code = HANDLERS[args.verb](args)
  except (Exception, KeyboardInterrupt) as e:  # pylint: disable=broad-exception-caught
    code = _report(args.verb, e, debug)
  if argv is None:
    _exit_promptly(code)
  return code


def _drop_traceback(record: logging.LogRecord) -> bool:
  record.exc_info, record.exc_text = None, None
  return True


def _quiet_library_tracebacks() -> None:
  """Libraries log the errors of their threads with a traceback (orbax, for a failed save); the
  command reports the error itself, in one message. Their one-line log messages stay, and
  warnings print as one line."""
  # orbax and jax log through absl; asyncio logs, whenever the garbage collector gets to them,
  # the failed writes of orbax's save tasks that no one awaited once the first had failed.
  for logger in (logging.getLogger("absl"), logging.getLogger("asyncio")):
    if _drop_traceback not in logger.filters:
      logger.addFilter(_drop_traceback)
  # tensorstore's callbacks report theirs as unraisable (after a failed save, orbax's event
  # loop is closed under them); each distinct one becomes a line.
  seen = set()

  def one_line(kind, value):
    line = f"{kind.__name__}: {value}"
    if line not in seen:
      seen.add(line)
      print(f"maxbridge: a library reported {line}", file=sys.stderr)

  sys.unraisablehook = lambda unraisable: one_line(unraisable.exc_type, unraisable.exc_value)
  sys.excepthook = lambda kind, value, tb: one_line(kind, value)
  warnings.formatwarning = lambda message, category, *rest, **kw: f"maxbridge: warning: {message}\n"


def _exit_promptly(code: int) -> None:
  """Exits now if a library left a non-daemon thread running after the command ended.

  Python waits for such threads at exit, for ever if they wait on each other
  (orbax's commit threads after a failed save did). The command's own work is
  done: a save in flight was waited for (`Checkpointer.close`).
  """
  deadline = time.monotonic() + EXIT_GRACE_S
  for thread in threading.enumerate():
    if thread is not threading.current_thread() and not thread.daemon:
      thread.join(max(0.0, deadline - time.monotonic()))
  if any(t.is_alive() and not t.daemon and t is not threading.current_thread() for t in threading.enumerate()):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
  sys.exit(main())
