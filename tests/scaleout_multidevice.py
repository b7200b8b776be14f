"""ZeRO-1 with gradient accumulation, and context parallelism, on 8 virtual CPU devices; prints one JSON report.

Started by tests/test_scaleout.py in a subprocess, because the device count
must be fixed (XLA_FLAGS) before JAX is imported. Every run trains STEPS steps
on packed rows (several documents per row: segment ids on) with gradient
accumulation 2, and is compared there with Linen on one device.
"""

import json
import os
import re
import sys

from fast_compile import xla_flags  # a constant; imports no JAX

os.environ["XLA_FLAGS"] = xla_flags(8)

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402

from maxbridge.training import data, recipe  # noqa: E402
from multidevice_checks import BACKENDS, config, single_device_mesh, specs  # noqa: E402

STEPS = 4
ROWS = 16  # two micro-batches of 8 rows: one per batch shard of data 2 x fsdp 4
COMMON = dict(gradient_accumulation_steps=2)
# llama-tiny with a 16-token sliding window (Mistral's attention, a family with no run of its own here): the
# window crosses the 32-token context slices. gemma2-tiny's alternates windowed and global layers.
WINDOW = {"llama-tiny": dict(sliding_window_size=16)}
ZERO1 = dict(shard_optimizer_over_data=True)
CONTEXT = dict(ici_context_parallelism=2)
# preset -> the backends each check runs on (the bridged one on llama-tiny only, to keep the compiles few)
ZERO1_RUNS = {
    "llama-tiny": ("linen", "nnx", "nnx-state/linen-model/nnx-decoder"),
    "deepseek3-tiny": ("linen", "nnx"),
}
CONTEXT_RUNS = {"llama-tiny": ("linen", "nnx"), "deepseek3-tiny": ("linen", "nnx")}


def run_config(backend, preset, shape=(1, 8, 1), **overrides):
  """`backend`'s config of `preset` on the (data, fsdp, tensor) mesh `shape`, with this script's common keys."""
  return config(BACKENDS[backend], shape, preset=preset, **COMMON, **WINDOW.get(preset, {}), **overrides)


def packed_rows(config):
  """STEPS batches of ROWS rows, each row packing several documents (3 to 40 tokens: segment ids on, positions
  restarting at each document), cut from the embedded corpus."""
  stream = data.make_dataset(config, "train", ROWS * STEPS).batch(0)["inputs"].reshape(-1)
  cuts = np.cumsum(np.random.default_rng(0).integers(3, 41, size=stream.size // 3))
  documents = np.split(stream, cuts[cuts < stream.size])
  rows = data.pack(documents, config.max_target_length)
  return [{key: value[step * ROWS : (step + 1) * ROWS] for key, value in rows.items()} for step in range(STEPS)]


def train(trainer):
  state, losses = trainer.init_state(0), []
  for batch in packed_rows(trainer.config):
    state, metrics = trainer.train_step(state, trainer.shard_batch(batch))
    losses.append(float(metrics["loss"]))
  return state, losses


def main():
  report = {"devices": jax.device_count(), "losses": {}, "zero1": {}, "context": {}}
  presets = sorted({*ZERO1_RUNS, *CONTEXT_RUNS})
  for preset in presets:
    one = recipe.create_trainer(run_config("linen", preset), single_device_mesh())
    _, report["losses"][f"{preset}@1"] = train(one)
  first = packed_rows(one.config)[0]
  report["segments_per_row"] = int(np.min(np.max(first["inputs_segmentation"], axis=1)))
  report["positions_restart"] = int(np.sum(first["inputs_position"] == 0))

  for preset, backends in ZERO1_RUNS.items():
    for name in backends:
      trainer = recipe.create_trainer(run_config(name, preset, (2, 4, 1), **ZERO1))
      state, report["losses"][f"{preset}/zero1/{name}"] = train(trainer)
      if name == "linen" or name == "nnx":
        # What the arrays hold, not only what the specs say: an Adam moment's shard per device.
        report["zero1"][f"{preset}/{name}"] = {
            "specs": specs(trainer),
            "shards": shard_shapes(trainer.to_checkpoint(state)),
        }

  for preset, backends in CONTEXT_RUNS.items():
    for name in backends:
      trainer = recipe.create_trainer(run_config(name, preset, (1, 2, 2), **CONTEXT))
      state, report["losses"][f"{preset}/context/{name}"] = train(trainer)
      report["context"][f"{preset}/{name}/mesh"] = dict(trainer.mesh.shape)
      if (preset, name) == ("llama-tiny", "nnx"):
        report["context"]["score_blocks"] = score_blocks(trainer, state)
        report["context"]["batch_spec"] = str(trainer.batch_sharding.spec)
  json.dump(report, sys.stdout)


def score_blocks(trainer, state):
  """The (queries x keys) blocks of the attention scores one device computes: float32 [rows, kv heads, group,
  queries, keys] arrays of the compiled step whose keys are the whole sequence."""
  lowered = trainer.lower_train_step(state, trainer.shard_batch(packed_rows(trainer.config)[0]))
  shapes = re.findall(r"f32\[\d+,\d+,\d+,(\d+),(\d+)\]", lowered.compile().as_text())
  return sorted({f"{q}x{k}" for q, k in shapes if int(k) == trainer.config.max_target_length})


def shard_shapes(tree):
  """Checkpoint path -> (global shape, one device's shard shape), for the embedding and its first Adam moment."""
  out = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    name = jax.tree_util.keystr(path)
    if name.endswith("['token_embedder']['embedding']") and ("['mu']" in name or name.startswith("['params']")):
      out[name] = [list(leaf.shape), list(leaf.addressable_shards[0].data.shape)]
  return out


if __name__ == "__main__":
  main()
