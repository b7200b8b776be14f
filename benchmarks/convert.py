"""Checkpoint conversion against a plain copy: throughput and peak memory, as ratios from one run.

    .venv/bin/python benchmarks/convert.py [--layers 3] [--emb 1024] [--keep DIR]

Makes a ~1 GB training checkpoint (parameters + Adam mu and nu, float32 random
values, saved with maxbridge's Checkpointer; nothing is trained), then on the
same folder:
  - copies it with shutil.copytree (the I/O floor: the same bytes, no work),
    and again followed by os.sync() (orbax syncs what it writes; a plain copy
    leaves it in the page cache),
  - converts it Linen -> NNX layout and scanned -> unscanned, in a subprocess
    whose peak RSS (VmHWM) is compared with the largest single array,
  - compares the result with the source (a correctness check, also timed).
The copy runs first, so both read the source from the page cache.
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

import maxbridge as mb
from maxbridge import checkpointing, dispatch

# Peak RSS is the child's VmHWM, not getrusage's ru_maxrss: Linux carries
# ru_maxrss across fork + exec, so a child would report this (larger) parent's peak.
CHILD = """
import json, sys
import converters
def status_kib(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1])
baseline = status_kib("VmRSS")  # the interpreter and libraries, before any array
conversion = converters.convert(sys.argv[1], sys.argv[2], layout="nnx", scan_layers=False, progress=True)
print(json.dumps({
    "baseline_kib": baseline,
    "peak_kib": status_kib("VmHWM"),
    "seconds": conversion.seconds,
    "arrays_read": conversion.arrays_read,
    "arrays_written": conversion.arrays_written,
}))
"""


def make_checkpoint(directory: Path, config: mb.Config) -> tuple[int, int, str]:
  """Writes a step-1 checkpoint of random float32 values; (total bytes, largest array bytes, its path)."""
  target = dispatch.create_trainer(config).checkpoint_target()
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
  return total, largest, path


def folder_bytes(path: Path) -> int:
  return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, default=3, help="decoder layers (default 3)")
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
    total, largest, largest_path = make_checkpoint(source, config)
    print(
        f"made {total / 2**30:.2f} GiB of arrays in {time.perf_counter() - began:.1f} s; largest array "
        f"{largest_path} {largest / 2**20:.0f} MiB; on disk {folder_bytes(source) / 2**30:.2f} GiB"
    )

    began = time.perf_counter()
    shutil.copytree(source, work / "copy")
    copy_s = time.perf_counter() - began
    os.sync()  # flush the copy, then time a second one to disk: orbax syncs what it writes
    began = time.perf_counter()
    shutil.copytree(source, work / "copy-synced")
    os.sync()
    synced_copy_s = time.perf_counter() - began

    began = time.perf_counter()
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(source), str(work / "converted")],
        capture_output=True,
        text=True,
    )
    convert_wall_s = time.perf_counter() - began
    if child.returncode:
      sys.exit(f"conversion failed:\n{child.stderr[-3000:]}")
    result = json.loads(child.stdout.strip().splitlines()[-1])

    began = time.perf_counter()
    check = subprocess.run(
        [sys.executable, "-m", "maxbridge.cli", "compare", str(source), str(work / "converted")],
        capture_output=True,
        text=True,
    )
    compare_s = time.perf_counter() - began

    peak, baseline = result["peak_kib"] * 1024, result["baseline_kib"] * 1024
    mib = 2**20
    print(
        f"convert: linen scanned -> nnx unscanned, {result['arrays_read']} arrays read, "
        f"{result['arrays_written']} written"
    )
    print(f"  copytree        {copy_s:7.2f} s   {total / mib / copy_s:8.0f} MiB/s")
    print(f"  copytree + sync {synced_copy_s:7.2f} s   {total / mib / synced_copy_s:8.0f} MiB/s")
    print(
        f"  convert         {result['seconds']:7.2f} s   {total / mib / result['seconds']:8.0f} MiB/s"
        f"   (wall with interpreter start-up {convert_wall_s:.2f} s)"
    )
    print(
        f"  throughput ratio convert/copy: {copy_s / result['seconds']:.2f}x; "
        f"convert/(copy + sync): {synced_copy_s / result['seconds']:.2f}x"
    )
    print(
        f"  peak RSS {peak / mib:.0f} MiB; after imports {baseline / mib:.0f} MiB; "
        f"largest array {largest / mib:.0f} MiB; checkpoint {total / mib:.0f} MiB"
    )
    print(
        f"  peak RSS / largest array: {peak / largest:.2f}x; "
        f"(peak - imports) / largest array: {(peak - baseline) / largest:.2f}x; "
        f"peak RSS / checkpoint: {peak / total:.2f}x"
    )
    print(
        f"  compare source vs converted: exit {check.returncode} in {compare_s:.1f} s: "
        f"{check.stdout.strip().splitlines()[-1] if check.stdout.strip() else check.stderr[-500:]}"
    )
  finally:
    if not args.keep:
      shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  main()
