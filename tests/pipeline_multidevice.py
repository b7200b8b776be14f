"""Pipeline parallelism on 8 virtual CPU devices; prints one JSON report.

Started by tests/test_pipeline.py in a subprocess, because the device count
must be fixed (XLA_FLAGS) before JAX is imported. Each run trains STEPS steps
and is compared there with the same config on one device (Linen).
"""

import json
import os
import sys
import tempfile

from fast_compile import xla_flags  # a constant; imports no JAX

os.environ["XLA_FLAGS"] = xla_flags(8)

import jax  # noqa: E402  (after XLA_FLAGS)

from maxbridge.core import canonical, checkpointing  # noqa: E402
from maxbridge.training import recipe  # noqa: E402
from multidevice_checks import BACKENDS, config, single_device_mesh, train  # noqa: E402

STEPS = 4
LLAMA = dict(base_num_decoder_layers=4)
# Vocabulary tiling, QK-Clip (a threshold low enough that heads are clipped),
# gradient accumulation and remat, under a GPipe pipeline (two layers a stage).
FEATURES = dict(
    LLAMA,
    num_vocab_tiling=4,
    use_qk_clip=True,
    qk_clip_threshold=0.5,
    gradient_accumulation_steps=2,
    remat_policy="full",
    num_layers_per_pipeline_stage=2,
)
# name -> (preset, its overrides, [(stages, fsdp, backends)]). With MaxText's
# default of one layer a stage, llama's 4 layers on 2 stages make a circular
# pipeline (2 repeats); on 4 stages, GPipe.
RUNS = {
    "llama": (
        "llama-tiny",
        LLAMA,
        [(2, 4, ("linen", "nnx", "nnx-state/linen-model/nnx-decoder")), (4, 2, ("linen", "nnx"))],
    ),
    # One dense layer outside the pipeline, two MoE layers in it.
    "deepseek": ("deepseek3-tiny", dict(base_num_decoder_layers=3), [(2, 4, ("linen", "nnx"))]),
    "features": ("llama-tiny", FEATURES, [(2, 4, ("linen", "nnx"))]),
}


def pipelined(flags, stages, fsdp, preset="llama-tiny", **overrides):
  return config(flags, (1, fsdp, 1), preset=preset, ici_pipeline_parallelism=stages, **overrides)


def main():
  report = {"devices": jax.device_count(), "losses": {}}
  trainers = {}
  for name, (preset, overrides, rows) in RUNS.items():
    one = recipe.create_trainer(config(BACKENDS["linen"], preset=preset, **overrides), single_device_mesh())
    _, report["losses"][f"{name}@1"] = train(one, STEPS)
    for stages, fsdp, backends in rows:
      for backend in backends:
        key = f"{name}/{backend}@{stages}x{fsdp}"
        trainers[key] = recipe.create_trainer(pipelined(BACKENDS[backend], stages, fsdp, preset, **overrides))
        _, report["losses"][key] = train(trainers[key], STEPS)
  fsdp = recipe.create_trainer(config(BACKENDS["nnx"], (1, 8, 1), **LLAMA))
  report["restore"] = {
      "pipeline->fsdp": restore(trainers["llama/linen@2x4"], fsdp),
      "fsdp->pipeline": restore(fsdp, trainers["llama/linen@2x4"]),
  }
  json.dump(report, sys.stdout)


def restore(saver, loader):
  """Two steps with `saver`, saved; restored by `loader` (another mesh and backend), two more steps."""
  with tempfile.TemporaryDirectory() as tmp:
    state, head = train(saver, 2)
    ckpt = checkpointing.Checkpointer(tmp)
    ckpt.save(2, saver.to_checkpoint(state))
    ckpt.wait()
    restored = loader.from_checkpoint(ckpt.restore(2, loader.checkpoint_target()))
    axis = saver.config.param_scan_axis
    same = canonical.fingerprint(saver.params(state), axis) == canonical.fingerprint(loader.params(restored), axis)
    _, tail = train(loader, 2, restored, start=2)
  return {"losses": head + tail, "params_equal": same}


if __name__ == "__main__":
  main()
