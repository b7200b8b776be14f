"""The newer families' parts that meet the sharding rules (gpt-oss, OLMo 2, Gemma 3/4, Llama 4, Qwen3-Next; which
and why: tests/families_multidevice.py): 8-device training matches one device.

One subprocess (tests/families_multidevice.py) for all of them, as the device
count is fixed before JAX is imported.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
from conftest import failure

MOE = ("gpt-oss-tiny", "llama4-tiny", "qwen3-next-tiny", "gemma4-moe-tiny")
DENSE = ("olmo2-tiny", "gemma3-tiny")


def test_training_on_8_devices_matches_one_device():
  script = Path(__file__).parent / "families_multidevice.py"
  proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=1800)
  assert proc.returncode == 0, failure(proc.stderr)
  report = json.loads(proc.stdout)
  assert report["devices"] == 8
  # Each family on 8 devices on one backend (families_multidevice.py says why), NNX on four of the six.
  assert sorted(key.split("/")[1] for key in report if key.endswith("@8")) == ["linen@8"] * 2 + ["nnx@8"] * 4
  for preset in MOE + DENSE:
    one = report[f"{preset}/linen@1"]
    assert len(one) >= 2 and np.all(np.isfinite(one)), (preset, one)
    backend = next(name for name in ("linen", "nnx") if f"{preset}/{name}@8" in report)
    np.testing.assert_allclose(report[f"{preset}/{backend}@8"], one, rtol=1e-4, err_msg=f"{preset} {backend}")
    shards = report[f"{preset}/{backend}/expert_shards"]
    if preset in MOE:
      # [experts, D, F] over expert=2, fsdp=2 (D) and tensor=2 (F): an eighth of it on each device.
      assert shards and all(np.prod(shard) * 8 == np.prod(full) and shard[0] * 2 == full[0] for full, shard in shards), (
          preset,
          backend,
          shards,
      )
    else:
      assert shards == [], (preset, shards)
