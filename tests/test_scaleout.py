"""ZeRO-1 with gradient accumulation, context parallelism and multi-process (dcn) meshes: each gives the losses of
one device.

The 8-device runs are one subprocess (tests/scaleout_multidevice.py); the dcn run is 2 processes of 4 CPU devices
each (tests/multiprocess_check.py), both because the device count is fixed when JAX starts.
"""

import json
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import failure

import maxbridge as mb
from maxbridge.core import sharding
from maxbridge.core.config import ConfigError

HERE = Path(__file__).parent
RUNS = {
    "zero1": {
        "llama-tiny": ("linen", "nnx", "nnx-state/linen-model/nnx-decoder"),
        "deepseek3-tiny": ("linen", "nnx"),
    },
    # llama-tiny with a sliding window of 16 (see scaleout_multidevice.py), deepseek3-tiny with MLA.
    "context": {"llama-tiny": ("linen", "nnx"), "deepseek3-tiny": ("linen", "nnx")},
}


@pytest.fixture(scope="module")
def report():
  proc = subprocess.run(
      [sys.executable, str(HERE / "scaleout_multidevice.py")], capture_output=True, text=True, timeout=900
  )
  assert proc.returncode == 0, failure(proc.stderr)
  return json.loads(proc.stdout)


def test_the_runs_are_on_eight_devices_with_packed_rows(report):
  assert report["devices"] == 8
  # Every row holds several documents, whose positions restart: segment ids and positions both matter.
  assert report["segments_per_row"] >= 2
  assert report["positions_restart"] > 16


@pytest.mark.parametrize(
    "check, preset, backend",
    [(check, preset, b) for check, runs in RUNS.items() for preset, bs in runs.items() for b in bs],
)
def test_sharded_training_matches_one_device(report, check, preset, backend):
  # data 2 x fsdp 4 with ZeRO-1; context 2 x fsdp 2 x tensor 2; both with gradient accumulation 2.
  np.testing.assert_allclose(report["losses"][f"{preset}/{check}/{backend}"], report["losses"][f"{preset}@1"], rtol=1e-4)


@pytest.mark.parametrize("preset", RUNS["zero1"])
@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_zero1_splits_the_optimizer_state_over_data_not_the_parameters(report, preset, backend):
  zero1 = report["zero1"][f"{preset}/{backend}"]
  params = {path: spec for path, spec in zero1["specs"].items() if path.startswith("['params']")}
  moments = {path: spec for path, spec in zero1["specs"].items() if "['mu']" in path or "['nu']" in path}
  assert params and moments
  assert not [path for path, spec in params.items() if "'data'" in spec]
  # Every moment of the tiny models has a dimension that divides over data: each is split.
  assert [path for path, spec in moments.items() if "'data'" not in spec] == []
  # The arrays as placed: the embedding [256, 64] over fsdp 4 (vocab over tensor 1), its first moment over
  # data 2 x fsdp 4.
  shards = {path.split("['token_embedder']")[0]: shapes for path, shapes in zero1["shards"].items()}
  assert shards["['params']['params']"] == [[256, 64], [256, 16]]
  assert shards["['opt_state'][0]['mu']['params']"] == [[256, 64], [256, 8]]


def test_context_splits_the_sequence_of_the_batch(report):
  # Each device scores its 32 queries against all 64 keys: queries split, keys and values gathered.
  assert report["context"]["score_blocks"] == ["32x64"]
  assert report["context"]["batch_spec"] == "P(('data', 'fsdp', 'expert'), 'context')"
  assert report["context"]["llama-tiny/nnx/mesh"] == {
      "diloco": 1,
      "data": 1,
      "stage": 1,
      "fsdp": 2,
      "context": 2,
      "tensor": 2,
      "expert": 1,
  }


def test_two_processes_over_a_dcn_data_axis_train_like_one_device(tmp_path):
  script = str(HERE / "multiprocess_check.py")
  common = ("steps=4", "enable_checkpointing=false")
  single = subprocess.Popen(
      [sys.executable, script, str(tmp_path), "single", "1", "0", "0", "1", "per_device_batch_size=8", *common],
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  port = str(free_port())
  multi = [
      subprocess.Popen(
          [sys.executable, script, str(tmp_path), "dcn", "2", str(i), port, "4", "per_device_batch_size=1"]
          + ["dcn_data_parallelism=2", *common],
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
      )
      for i in range(2)
  ]
  outputs = []
  for proc in (single, *multi):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    outputs.append(json.loads(out.strip().splitlines()[-1]))
  mesh = {"diloco": 1, "data": 2, "stage": 1, "fsdp": 4, "context": 1, "tensor": 1, "expert": 1}
  assert outputs[1] == outputs[2] == mesh

  def losses(run):
    return [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

  assert len(losses("dcn")) == 4
  np.testing.assert_allclose(losses("dcn"), losses("single"), rtol=1e-4)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


# --- the configuration, in process -------------------------------------------


def test_dcn_mesh_shapes_and_errors():
  config = mb.load_config("llama-tiny", ici_fsdp_parallelism=-1)
  # The dcn axes multiply the ici ones: each process's 4 devices are fsdp 4, the 2 processes data 2.
  assert sharding.mesh_shape(config.replace(dcn_data_parallelism=2), 8, 2) == (1, 2, 1, 4, 1, 1, 1)
  assert sharding.mesh_shape(config.replace(dcn_fsdp_parallelism=-1), 8, 2) == (1, 1, 1, 8, 1, 1, 1)
  assert sharding.dcn_shape(config.replace(dcn_fsdp_parallelism=-1), 2) == (1, 1, 1, 2, 1, 1, 1)
  # All dcn keys at 1: one mesh over every device of every process, as before.
  assert sharding.mesh_shape(config, 8, 2) == (1, 1, 1, 8, 1, 1, 1)
  with pytest.raises(ConfigError, match=r"dcn_data_parallelism=2 split the mesh over processes, but this run has one"):
    sharding.mesh_shape(config.replace(dcn_data_parallelism=2), 8, 1)
  with pytest.raises(ConfigError, match=r"dcn_data_parallelism=2, .* needs 2 processes, but 4 are available"):
    sharding.mesh_shape(config.replace(dcn_data_parallelism=2), 8, 4)
  with pytest.raises(ConfigError, match=r"ici_fsdp_parallelism=2, .* needs 2 devices per process, but 4 are"):
    sharding.mesh_shape(config.replace(dcn_data_parallelism=2, ici_fsdp_parallelism=2), 8, 2)
  with pytest.raises(ConfigError, match=r"only one of dcn_diloco_parallelism, dcn_data_parallelism, .* may be -1"):
    sharding.mesh_shape(config.replace(dcn_data_parallelism=-1, dcn_fsdp_parallelism=-1), 8, 2)
  with pytest.raises(ConfigError, match=r"'dcn_fsdp_parallelism' = 0 is invalid; it must be a positive integer, or -1"):
    config.replace(dcn_fsdp_parallelism=0)
  with pytest.raises(ConfigError, match=r"'dcn_pipeline_parallelism' = -1 is invalid; it must be a positive integer"):
    config.replace(dcn_pipeline_parallelism=-1)


def test_context_parallelism_refuses_what_it_does_not_compute():
  with pytest.raises(ConfigError, match=r"context_parallel_strategy='ring' \(ring attention\) is not implemented"):
    mb.load_config("llama-tiny", context_parallel_strategy="ring")
  with pytest.raises(ConfigError, match=r"ici_context_parallelism=3 .* max_target_length=64 must be a multiple"):
    mb.load_config("llama-tiny", ici_context_parallelism=3)
  with pytest.raises(ConfigError, match=r"'context_parallel_strategy' = 'ulysses' is invalid; valid values"):
    mb.load_config("llama-tiny", context_parallel_strategy="ulysses")
  # MaxText's load balancing moves where each token's attention runs, never what it computes.
  with pytest.warns(UserWarning, match=r"ignoring MaxText config keys .*: context_parallel_load_balance"):
    mb.load_config("llama-tiny", context_parallel_load_balance=True, ici_context_parallelism=2)
