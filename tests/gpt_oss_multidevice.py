"""gpt-oss-tiny trained on 8 virtual CPU devices (fsdp x tensor x expert) and on one; prints one JSON report.

Started by tests/test_gpt_oss.py in a subprocess, because the device count
must be fixed (XLA_FLAGS) before JAX is imported.
"""

import json
import os
import sys

from fast_compile import xla_flags  # a constant; imports no JAX

os.environ["XLA_FLAGS"] = xla_flags(8)

import jax  # noqa: E402  (after XLA_FLAGS)

from maxbridge.core import canonical  # noqa: E402
from multidevice_checks import BACKENDS, STEPS, config, single_device_mesh, train  # noqa: E402
from maxbridge.training import recipe  # noqa: E402

PRESET = "gpt-oss-tiny"


def main():
  report = {}
  for name in ("linen", "nnx"):
    flags = BACKENDS[name]
    _, report[f"{name}@1"] = train(recipe.create_trainer(config(flags, preset=PRESET), single_device_mesh()), STEPS)
    trainer = recipe.create_trainer(config(flags, (1, 2, 2, 2), preset=PRESET))
    state, report[f"{name}@1x2x2x2"] = train(trainer, STEPS)
    # What each device holds of the experts' fused kernel: half the experts, half of each expert.
    report[f"{name}/wi_shards"] = sorted(
        {
            (tuple(leaf.shape), tuple(shard.data.shape))
            for path, leaf in canonical.flatten(trainer.params(state)).items()
            if path.endswith("MoeBlock_0/wi")
            for shard in leaf.addressable_shards
        }
    )
  report["devices"] = jax.device_count()
  json.dump(report, sys.stdout)


if __name__ == "__main__":
  main()
