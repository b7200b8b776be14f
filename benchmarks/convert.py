"""Checkpoint conversion and comparison against a plain copy: throughput and peak memory, as ratios from one run.

    .venv/bin/python benchmarks/convert.py [--layers 10] [--emb 1024] [--keep DIR]

Makes a training checkpoint (parameters + Adam mu and nu, float32 random
values; nothing is trained; 2.25 GiB by default), saved twice: with
maxbridge's Checkpointer, which stores a stack one chunk per layer, and with
orbax's defaults, one chunk per stack (as MaxText saves on one device). Then:
  - copies each step's source with shutil.copytree (the same bytes, no work),
    and again followed by an fsync of every file (a conversion fsyncs what it
    writes, as orbax does; a plain copy leaves it in the page cache): the two
    baselines, measured again right before each step. Every file the copy or
    the step reads is read once beforehand, untimed, so that both find it in
    the page cache (left alone, the kernel evicts it at moments that vary from
    run to run). The writes still vary, with the dirty pages the kernel is
    writing back at the time: the plain copy swung 0.9-6.0 s in one run;
  - converts the first Linen -> NNX (a layout-only conversion: renamed, not
    decoded), Linen scanned -> NNX unscanned and back (chunks moved, not
    decoded), each in a subprocess whose peak RSS above its imports (VmHWM -
    VmRSS after `import converters`) is compared with the largest array;
  - compares each result with the source (`maxbridge compare`, also in a
    subprocess, timed and measured the same way);
  - unscans the orbax-default copy, whose stacks are stored as one chunk each
    and are decoded as a stream, a piece of every layer at a time (and
    compares it), and the same saved in zarr3 (MaxText's default).
os.sync() runs between steps (untimed), so that no step pays for writing back
what the one before it left in the page cache, and as many bytes as the step
or copy writes are written and removed right before it (`fault_in`), so that
neither pays the hypervisor for faulting in pages left free a while.
Everything is written under a temporary folder, removed at the end.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

import maxbridge as mb
from maxbridge.core import checkpointing
from maxbridge.training import recipe

# Peak RSS is the child's VmHWM, not getrusage's ru_maxrss: Linux carries
# ru_maxrss across fork + exec, so a child would report this (larger) parent's peak.
CHILD = """
import json, sys, time
import converters
def status_kib(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
baseline = status_kib("VmRSS")  # the interpreter and libraries, before any array
began = time.perf_counter()
if sys.argv[1] == "compare":
    result = converters.compare(sys.argv[2], sys.argv[3])
    assert result.equal, result.report()
else:
    options = {
        "layout": dict(layout="nnx"),
        "unscan": dict(layout="nnx", scan_layers=False),
        "stack": dict(layout="linen", scan_layers=True),
    }[sys.argv[1]]
    converters.convert(sys.argv[2], sys.argv[3], progress=False, **options)
print(json.dumps({"baseline_kib": baseline, "peak_kib": status_kib("VmHWM"), "seconds": time.perf_counter() - began}))
"""


def make_checkpoint(
    directory: Path, config: mb.Config, orbax_directory: Path, zarr3_directory: Path
) -> tuple[int, int, str]:
  """Writes a step-1 checkpoint of random float32 values; (total bytes, largest array bytes, its path).

  Twice: with maxbridge's Checkpointer (one chunk per layer of a stack) into `directory`, and with
  orbax's defaults (one chunk per stack, as MaxText saves on one device) into `orbax_directory`, and
  the same in zarr3 (MaxText's default checkpoint_storage_use_zarr3) into `zarr3_directory`.
  """
  target = recipe.create_trainer(config).checkpoint_target()
  rng = np.random.default_rng(0)
  tree = jax.tree.map(
      lambda leaf: (
          rng.standard_normal(leaf.shape, np.float32)
          if np.issubdtype(leaf.dtype, np.floating)
          else np.ones(leaf.shape, leaf.dtype)
      ),
      target,
  )
  leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
  path, largest = max(((jax.tree_util.keystr(k), v.nbytes) for k, v in leaves), key=lambda x: x[1])
  total = sum(v.nbytes for _, v in leaves)
  ckpt = checkpointing.Checkpointer(directory / "checkpoints")
  ckpt.save(1, tree)
  ckpt.wait()
  ckpt.close()
  config.to_yaml(directory / "config.yml")
  for folder, zarr3 in ((orbax_directory, False), (zarr3_directory, True)):
    handler = ocp.PyTreeCheckpointHandler(use_zarr3=zarr3)
    manager = ocp.CheckpointManager(folder / "checkpoints", item_handlers={"items": handler})
    manager.save(1, args=ocp.args.Composite(items=ocp.args.PyTreeSave(tree)))
    manager.wait_until_finished()
    manager.close()
    config.to_yaml(folder / "config.yml")
  return total, largest, path


def folder_bytes(path: Path) -> int:
  return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def fsync_all(path: Path) -> None:
  for p in path.rglob("*"):
    if p.is_file():
      with open(p, "rb") as f:
        os.fsync(f.fileno())


def warm(*folders: Path) -> None:
  for folder in folders:
    for p in folder.rglob("*"):
      if p.is_file():
        with open(p, "rb") as f:
          while f.read(1 << 24):
            pass


def fault_in(scratch: Path, nbytes: int) -> None:
  """Writes and removes `nbytes` of zeros in `scratch`, then syncs: the page cache's next writes reuse pages the
  guest has just freed. On this VM, pages left free a while cost the hypervisor a fault each when written again:
  2.3 GiB written from /dev/zero into the page cache took 5.5 s, and 0.37 s right after."""
  block = bytes(16 << 20)
  with open(scratch, "wb") as f:
    for _ in range(-(-nbytes // len(block))):
      f.write(block)
  scratch.unlink()
  os.sync()


def copy_seconds(source: Path, copy: Path, sync: bool) -> float:
  """Seconds to copy `source` (and fsync the copy); the copy is removed and flushed after, untimed."""
  os.sync()
  warm(source)
  fault_in(copy.parent / "scratch", folder_bytes(source))
  began = time.perf_counter()
  shutil.copytree(source, copy)
  if sync:
    fsync_all(copy)
  seconds = time.perf_counter() - began
  shutil.rmtree(copy)
  os.sync()
  return seconds


def child(*argv: str) -> dict:
  began = time.perf_counter()
  run = subprocess.run([sys.executable, "-c", CHILD, *argv], capture_output=True, text=True)
  if run.returncode:
    sys.exit(f"{argv[0]} failed:\n{run.stderr[-3000:]}")
  return {**json.loads(run.stdout.strip().splitlines()[-1]), "wall": time.perf_counter() - began}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=10, help="decoder layers (default 10)")
  parser.add_argument("--emb", type=int, default=1024, help="model width (default 1024)")
  parser.add_argument("--vocab", type=int, default=16384, help="vocabulary (default 16384)")
  parser.add_argument("--keep", help="work in this folder and keep it (default: a temporary folder, removed)")
  args = parser.parse_args()
  config = mb.load_config(
      "llama-tiny",
      base_emb_dim=args.emb,
      base_mlp_dim=4 * args.emb,
      base_num_query_heads=args.emb // 128,
      base_num_kv_heads=args.emb // 128,
      head_dim=128,
      base_num_decoder_layers=args.layers,
      vocab_size=args.vocab,
  )
  work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="convert-bench-"))
  try:
    source = work / "source"
    began = time.perf_counter()
    orbax_source = work / "orbax-source"
    zarr3_source = work / "zarr3-source"
    total, largest, largest_path = make_checkpoint(source, config, orbax_source, zarr3_source)
    on_disk = folder_bytes(source)
    print(
        f"made {total / 2**30:.2f} GiB of arrays in {time.perf_counter() - began:.1f} s; largest array "
        f"{largest_path} {largest / 2**20:.0f} MiB; on disk {on_disk / 2**30:.2f} GiB"
    )
    os.sync()
    mib = 2**20
    print(f"checkpoint {total / mib:.0f} MiB of arrays; largest array {largest / mib:.0f} MiB")
    print(
        f"  {'':28s} {'seconds':>8s} {'MiB/s':>7s} {'copy s':>7s} {'vs copy':>8s} {'copy+fsync s':>13s} "
        f"{'vs copy+fsync':>14s} {'peak/largest':>13s}"
    )
    rows = [
        ("convert linen -> nnx", "layout", source, work / "nnx"),
        ("compare source, nnx", "compare", source, work / "nnx"),
        ("convert scanned -> unscanned", "unscan", source, work / "unscanned"),
        ("compare source, unscanned", "compare", source, work / "unscanned"),
        ("convert unscanned -> scanned", "stack", work / "unscanned", work / "rescanned"),
        # Orbax's default layout: each stack one chunk, decoded as a stream in pieces of every layer.
        ("orbax: scanned -> unscanned", "unscan", orbax_source, work / "orbax-unscanned"),
        ("orbax: compare that", "compare", orbax_source, work / "orbax-unscanned"),
        ("orbax zarr3: -> unscanned", "unscan", zarr3_source, work / "zarr3-unscanned"),
    ]
    for label, verb, first, second in rows:
      copy_s, synced_s = copy_seconds(first, work / "copy", sync=False), copy_seconds(first, work / "copy", sync=True)
      os.sync()
      warm(first, *([second] if verb == "compare" else []))
      fault_in(work / "scratch", folder_bytes(first))
      result = child(verb, str(first), str(second))
      seconds, above = result["seconds"], (result["peak_kib"] - result["baseline_kib"]) * 1024
      print(
          f"  {label:28s} {seconds:8.2f} {total / mib / seconds:7.0f} {copy_s:7.2f} {copy_s / seconds:7.2f}x "
          f"{synced_s:13.2f} {synced_s / seconds:13.2f}x {above / largest:12.2f}x"
      )
    print(
        "  (copy s: a copy of the step's source measured right before it, both reading from the page cache; "
        "ratios: higher is faster, 1.0x = as fast as that copy; peak/largest: the process's peak RSS above its "
        "imports, over the largest array)"
    )
  finally:
    if not args.keep:
      shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  main()
