"""Saving and restoring a full train state, against the raw bytes, on both backends (MaxText's standalone_checkpointer).

    .venv/bin/python benchmarks/checkpoint.py [--preset llama-small] [--rounds 3] [--devices 8]

For pure Linen and pure NNX, one process: the train state (parameters, Adam
mu and nu, step) of `--preset` on an fsdp mesh over `--devices` virtual CPU
devices is
  - written as raw bytes (each array's local shards to one .npy file, then
    os.sync: the floor for the same bytes on the same disk),
  - saved with maxbridge's Checkpointer (orbax, synced as it commits),
  - restored onto the mesh it was saved from,
  - restored onto another mesh (fsdp x tensor), as a resume on a new slice does,
  - saved and restored (same mesh) with digests off (`Checkpointer(digests=False)`):
    what recording a digest of every array on save and checking it on restore costs.
Each is the median of `--rounds` interleaved rounds; ratios are throughput vs
the raw write (save) and vs reading the raw bytes back (restore), and, last,
the time with digests over the time without. Everything goes under a
temporary folder, removed at the end.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":
  # Before JAX is imported: the device count is fixed then.
  devices = sys.argv[sys.argv.index("--devices") + 1] if "--devices" in sys.argv else "8"
  os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import maxbridge as mb  # noqa: E402
from maxbridge.core import checkpointing  # noqa: E402
from maxbridge.training import recipe

BACKENDS = {"linen": (False, False, False), "nnx": (True, True, True)}


def raw_write(tree, folder: Path) -> None:
  folder.mkdir()
  for i, leaf in enumerate(jax.tree.leaves(tree)):
    np.save(folder / f"{i}.npy", np.asarray(leaf))
  os.sync()


def raw_read(folder: Path) -> list:
  return [np.load(path) for path in sorted(folder.iterdir())]


def timed(fn) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="llama-small")
  parser.add_argument("--rounds", type=int, default=3)
  parser.add_argument("--devices", type=int, default=8)
  args = parser.parse_args()
  n = jax.device_count()
  print(f"{args.preset}, {n} devices: saved on fsdp={n}, restored on fsdp={n} and on fsdp={n // 2} x tensor=2")

  with tempfile.TemporaryDirectory() as tmp:
    cases = {}
    for backend, (pure_nnx, enable_nnx, decoder) in BACKENDS.items():
      flags = dict(pure_nnx=pure_nnx, enable_nnx=enable_nnx, pure_nnx_decoder=decoder)
      saver = recipe.create_trainer(mb.load_config(args.preset, **flags, ici_fsdp_parallelism=n))
      other = recipe.create_trainer(
          mb.load_config(args.preset, **flags, ici_fsdp_parallelism=n // 2, ici_tensor_parallelism=2)
      )
      tree = saver.to_checkpoint(saver.init_state(0))
      nbytes = sum(leaf.nbytes for leaf in jax.tree.leaves(tree))
      cases[backend] = {"saver": saver, "other": other, "tree": tree, "bytes": nbytes, "times": {}}

    for round_ in range(args.rounds):
      for backend, case in cases.items():
        folder = Path(tmp) / f"{backend}-{round_}"
        ckpt = checkpointing.Checkpointer(folder / "ckpt")
        bare = checkpointing.Checkpointer(folder / "bare", digests=False)

        def save(ckpt=ckpt, case=case):
          ckpt.save(1, case["fresh"])
          ckpt.wait()

        # New arrays for each save, as training gives it: jax caches an array's host copy once it has made one.
        case["fresh"] = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), case["tree"]))

        times = case["times"]
        times.setdefault("raw write", []).append(timed(lambda: raw_write(case["tree"], folder / "raw")))
        times.setdefault("save", []).append(timed(save))
        case["fresh"] = jax.block_until_ready(jax.tree.map(lambda x: x.copy(), case["tree"]))
        times.setdefault("save, no digests", []).append(timed(lambda bare=bare: save(bare)))
        times.setdefault("raw read", []).append(timed(lambda: raw_read(folder / "raw")))
        for name, trainer in (("restore, same mesh", case["saver"]), ("restore, other mesh", case["other"])):
          restore = lambda trainer=trainer: ckpt.restore(1, trainer.checkpoint_target())  # noqa: E731
          times.setdefault(name, []).append(timed(restore))
        bare_restore = lambda bare=bare, case=case: bare.restore(1, case["saver"].checkpoint_target())  # noqa: E731
        times.setdefault("restore, no digests", []).append(timed(bare_restore))

    print(f"{'backend':>7} {'MiB':>7} {'operation':>20} {'s':>7} {'MiB/s':>8} {'vs raw':>7}")
    for backend, case in cases.items():
      mib = case["bytes"] / 2**20
      seconds = {name: statistics.median(t) for name, t in case["times"].items()}
      for name, s in seconds.items():
        raw = seconds["raw write" if name.startswith(("raw write", "save")) else "raw read"]
        print(f"{backend:>7} {mib:>7.1f} {name:>20} {s:>7.3f} {mib / s:>8.1f} {raw / s:>7.2f}")
    print(f"{'backend':>7} {'digests: save':>14} {'restore':>8}  (time with digests / time without)")
    for backend, case in cases.items():
      seconds = {name: statistics.median(t) for name, t in case["times"].items()}
      save = seconds["save"] / seconds["save, no digests"]
      restore = seconds["restore, same mesh"] / seconds["restore, no digests"]
      print(f"{backend:>7} {save:>13.2f}x {restore:>7.2f}x")


if __name__ == "__main__":
  main()
