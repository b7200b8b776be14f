"""Fitting on TPUs: compiled memory per chip of real models' train steps on TPU slices, compiled on this host.

    .venv/bin/python benchmarks/fit.py [--rows 8b-v6e-flash 70b-v5p-64] [--backends nnx linen]
                                       [--timeout 900] [key=value ...]

Each row compiles one train step with `aot.compile_train_step` for a TPU slice
this host does not have (`compile_topology`, libtpu's compiler; no TPU needed),
in a fresh subprocess (a compile of a real model holds gigabytes), once per
backend: NNX (pure_nnx, enable_nnx and pure_nnx_decoder true, the default) and
Linen (all three false). Settings as issue 45's (MaxText's train_compile
figures): batch 1 per chip, remat_policy=full, bfloat16 activations, float32
weights, fsdp over all chips (the default mesh); `key=value` arguments apply to
every row after its own.

How to read it: all columns are per chip. `state` is parameters + Adam
moments as sharded; `temporaries` what the step allocates beyond its
arguments (activations kept for the backward pass, gradients, attention
scores); `peak` the most live at once (XLA's `peak_memory_in_bytes`), which must
stay under the chip's HBM (v5p 95 GiB, v6e 31.25 GiB); `bytes accessed` XLA's
cost analysis of HBM traffic for one step (a scanned layer counts once, as in
MaxText's figures). A step that does not fit is the compiler's own verdict
("does not fit (needs X GiB, Y available)"). `compile s` is the lowering and
compile of one step on this host, not the step time.
"""

import argparse
import json
import subprocess
import sys
import time

COMMON = ("per_device_batch_size=1", "remat_policy=full", "dtype=bfloat16", "weight_dtype=float32")
BACKENDS = {
    "nnx": ("pure_nnx=true", "enable_nnx=true", "pure_nnx_decoder=true"),
    "linen": ("pure_nnx=false", "enable_nnx=false", "pure_nnx_decoder=false"),
}
# name: (preset, topology, overrides). A slice for each model where its state (~12 bytes a parameter:
# float32 weights and two Adam moments) takes at most a third of HBM.
ROWS = {
    "8b-v6e-flash": ("llama3.1-8b", "v6e-8", ("attention=flash", "max_target_length=8192")),
    "8b-v6e-dot": ("llama3.1-8b", "v6e-8", ("attention=dot_product", "max_target_length=8192")),
    "8b-v5p-flash": ("llama3.1-8b", "v5p-8", ("attention=flash", "max_target_length=8192")),
    "8b-v5p-dot": ("llama3.1-8b", "v5p-8", ("attention=dot_product", "max_target_length=8192")),
    "gemma3-12b-v5p-8": ("gemma3-12b", "v5p-8", ("attention=flash", "max_target_length=8192")),
    "mixtral-8x7b-v5p-32": ("mixtral-8x7b", "v5p-32", ("attention=flash", "max_target_length=8192")),
    "70b-v5p-64": ("llama3.1-70b", "v5p-64", ("attention=flash", "max_target_length=8192")),
}
# MaxText 0.2.5's figures for Llama 3.1 8B at 8192 tokens (issue 45): (peak, temporaries) GiB, bytes accessed.
MAXTEXT = {
    "8b-v6e-flash": (22.2, 15.1, 1.03e11),
    "8b-v6e-dot": (28.9, 23.0, 1.60e11),
    "8b-v5p-flash": (36.8, 18.0, 1.22e11),
    "8b-v5p-dot": (47.4, 35.0, 1.84e11),
}

CHILD = """
import json, sys, time
from maxbridge.core.config import load_config
from maxbridge.training import aot, topology
config = load_config(sys.argv[1], *sys.argv[2:])
began = time.perf_counter()
try:
  result = aot.compile_train_step(config)
except Exception as e:
  sizes = topology.out_of_memory(e)
  if sizes is None:
    raise
  result = {"needed": sizes[0], "available": sizes[1]}
result["seconds"] = time.perf_counter() - began
print(json.dumps(result, default=str))
"""


def compile_row(preset: str, overrides: list[str], timeout: float) -> dict:
  """The child's result dict, or {"error": why} when it crashed or ran past `timeout` seconds."""
  began = time.perf_counter()
  try:
    run = subprocess.run(
        [sys.executable, "-c", CHILD, preset, *overrides], capture_output=True, text=True, timeout=timeout
    )
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout:.0f} s", "seconds": time.perf_counter() - began}
  if run.returncode:
    last = [line for line in run.stderr.splitlines() if line.strip()][-1:] or [f"exit {run.returncode}"]
    return {"error": f"failed: {last[0][:200]}", "seconds": time.perf_counter() - began}
  return json.loads(run.stdout.strip().splitlines()[-1])


def cells(result: dict) -> list[str]:
  """temporaries, peak, state, bytes accessed and compile seconds as table cells."""
  gib = 2**30
  seconds = f"{result['seconds']:.0f}"
  if "error" in result:
    return [result["error"], "", "", "", seconds]
  if "needed" in result:
    verdict = f"does not fit (needs {result['needed'] / gib:.2f} GiB, {result['available'] / gib:.2f} available)"
    return [verdict, "", "", "", seconds]
  return [
      f"{result['temp_bytes'] / gib:.2f}",
      f"{result['peak_bytes'] / gib:.2f}",
      f"{result['state_bytes'] / gib:.2f}",
      f"{result['bytes_accessed']:.3g}",
      seconds,
  ]


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS), help="rows by name (default all)")
  parser.add_argument("--backends", nargs="+", choices=list(BACKENDS), default=list(BACKENDS))
  parser.add_argument("--timeout", type=float, default=900, help="seconds per compile (default 900)")
  parser.add_argument("overrides", nargs="*", help="key=value for every row, after its own")
  args = parser.parse_args()

  header = (
      "model",
      "topology",
      "backend",
      "attention",
      "temporaries/chip GiB",
      "peak/chip GiB",
      "state/chip GiB",
      "HBM bytes accessed",
      "compile s",
      "MaxText 0.2.5 peak / temporaries GiB, bytes",
  )
  print("| " + " | ".join(header) + " |")
  print("|" + "---|" * len(header), flush=True)
  for name in args.rows:
    preset, slice_name, overrides = ROWS[name]
    maxtext = "{} / {} / {:.3g}".format(*MAXTEXT[name]) if name in MAXTEXT else ""
    for backend in args.backends:
      settings = [*COMMON, *BACKENDS[backend], f"compile_topology={slice_name}", *overrides, *args.overrides]
      result = compile_row(preset, settings, args.timeout)
      attention = [s.split("=", 1)[1] for s in settings if s.startswith("attention=")][-1]
      row = [preset, slice_name, backend, attention, *cells(result), maxtext]
      print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
  main()
