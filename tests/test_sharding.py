"""Sharding on 8 virtual CPU devices, and a 2-process run on localhost.

The scenarios run in subprocesses: the device count is fixed when JAX starts.
"""

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from jax.sharding import PartitionSpec

import maxbridge as mb
from maxbridge.core import sharding
from maxbridge.core.config import ConfigError
from conftest import LINEN_ARGS, failure

HERE = Path(__file__).parent


@pytest.fixture(scope="module")
def report():
  proc = subprocess.run(
      [sys.executable, str(HERE / "multidevice_checks.py")], capture_output=True, text=True, timeout=1200
  )
  assert proc.returncode == 0, failure(proc.stderr)
  return {**json.loads(proc.stdout), "stderr": proc.stderr}


def test_eight_devices_are_used(report):
  assert report["devices"] == 8


def test_no_array_is_resharded_by_replicating_it(report):
  # XLA's warning when it cannot reshard an array efficiently; on the 2x2x2
  # mesh the embedding lookup did so until its table was gathered over fsdp.
  # The expert-parallel runs come after the marker: their grouped matmul still does.
  dense, _ = report["stderr"].split("=== expert parallelism ===")
  assert "Involuntary full rematerialization" not in dense


@pytest.mark.parametrize("mesh", ["8x1x1", "1x8x1", "1x4x2", "2x2x2"])
@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_sharded_training_matches_one_device(report, backend, mesh):
  np.testing.assert_allclose(report["losses"][f"{backend}@{mesh}"], report["losses"]["linen@1"], rtol=1e-4)


@pytest.mark.parametrize("backend", ["nnx-state/linen-model/nnx-decoder", "linen-state/nnx-model/linen-decoder"])
def test_bridged_backends_train_sharded_to_the_same_losses(report, backend):
  np.testing.assert_allclose(report["losses"][f"{backend}@2x2x2"], report["losses"]["linen@1"], rtol=1e-4)


def test_every_backend_reports_identical_partition_specs(report):
  specs = report["specs"]
  for name, table in specs.items():
    reference = specs["linen@" + name.split("@")[1]]
    assert table.keys() == reference.keys(), name
    differing = {path: (table[path], reference[path]) for path in table if table[path] != reference[path]}
    assert not differing, f"{name}: {differing}"


def test_partition_specs_follow_the_logical_rules(report):
  specs = report["specs"]["nnx@1x4x2"]
  wi_0 = "['params']['params']['decoder']['layers']['mlp']['wi_0']['kernel']"
  assert specs[wi_0] == "P(('fsdp', 'context'), 'stage', 'tensor')"  # (embed, layers, mlp); one stage here
  assert specs[wi_0.replace("['params']['params']", "['opt_state'][0]['mu']['params']")] == specs[wi_0]
  assert specs["['params']['params']['token_embedder']['embedding']"] == "P('tensor', ('fsdp', 'context'))"
  assert specs["['step']"] == "P()"


@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_vocab_tiling_and_qk_clip_train_sharded_to_the_one_device_losses(report, backend):
  features = report["features"]
  np.testing.assert_allclose(features[f"{backend}@2x2x2"], features["linen@1"], rtol=1e-4)
  np.testing.assert_allclose(features[f"{backend}@1"], features["linen@1"], rtol=1e-6)
  # The features change the numbers (QK-Clip clips), so the comparison above is not the plain run's.
  assert features["linen@1"][1:] != report["losses"]["linen@1"][1:]


@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_qlora_with_dropout_trains_sharded_to_the_one_device_losses_and_keeps_its_base(report, backend):
  lora = report["lora"]
  np.testing.assert_allclose(lora[f"{backend}@2x2x2"], lora[f"{backend}@1"], rtol=1e-4)
  np.testing.assert_allclose(lora[f"{backend}@1"], lora["linen@1"], rtol=0, atol=1e-5)
  assert lora[f"{backend}@1"][-1] < lora[f"{backend}@1"][0]
  assert lora[f"{backend}/base_unchanged"]


@pytest.mark.parametrize("preset", ["mixtral-tiny", "deepseek3-tiny", "qwen3-moe-tiny"])
@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_expert_parallel_training_matches_one_device_with_the_experts_split(report, preset, backend):
  experts = report["experts"]
  np.testing.assert_allclose(experts[f"{preset}/{backend}@1x2x1x4"], experts[f"{preset}/linen@1"], rtol=1e-4)
  specs = experts[f"{preset}/{backend}/specs"]
  routed = [spec for path, spec in specs.items() if "MoeBlock_0']['wi_0']" in path or "moe_block']['wi_0']" in path]
  assert routed and all(spec.startswith("P('expert'") for spec in routed), specs
  # Over expert=4 and fsdp=2, each device holds a quarter of the experts, an eighth of each kernel.
  shards = experts[f"{preset}/{backend}/shards"]
  assert shards
  for full, shard in shards:
    assert shard[0] * 4 == full[0] and np.prod(shard) * 8 == np.prod(full), (full, shard)


def test_restore_onto_another_mesh_and_backend_continues_exactly(report):
  assert report["restore"]["shardings_as_target"]
  np.testing.assert_allclose(report["restore"]["losses"], report["losses"]["linen@1"], rtol=1e-4)


def test_a_logical_axis_without_a_rule_is_replicated_not_fatal(report):
  assert report["missing_rule"]["wi_0"] == "P(('fsdp', 'context'), 'stage', None)"
  np.testing.assert_allclose(report["missing_rule"]["loss"], report["losses"]["linen@1"][0], rtol=1e-4)


def test_mesh_shape_is_checked_against_the_device_count():
  config = mb.load_config("llama-tiny", ici_fsdp_parallelism=4, ici_tensor_parallelism=3)
  with pytest.raises(ConfigError, match=r"needs 12 devices, but 8 are available"):
    sharding.mesh_shape(config, 8)
  with pytest.raises(ConfigError, match=r"only one of .* may be -1"):
    sharding.mesh_shape(config.replace(ici_data_parallelism=-1, ici_fsdp_parallelism=-1), 8)
  shape = sharding.mesh_shape(config.replace(ici_fsdp_parallelism=-1, ici_tensor_parallelism=2), 8)
  assert shape == (1, 1, 1, 4, 1, 2, 1)


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def test_two_processes_train_like_one(tmp_path):
  script = str(HERE / "multiprocess_check.py")
  single = subprocess.run(
      [sys.executable, script, str(tmp_path), "single", "1", "0", "0", "2"], capture_output=True, text=True, timeout=600
  )
  assert single.returncode == 0, single.stderr[-3000:]
  port = str(free_port())
  procs = [
      subprocess.Popen(
          [sys.executable, script, str(tmp_path), "multi", "2", str(i), port, "1"],
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
      )
      for i in range(2)
  ]
  for proc in procs:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]

  def losses(run):
    return [json.loads(line)["loss"] for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

  assert len(losses("multi")) == 2
  np.testing.assert_allclose(losses("multi"), losses("single"), rtol=1e-5)
  assert (tmp_path / "multi" / "checkpoints" / "2" / "items").is_dir()


def maxbridge_cli(*args: str) -> str:
  proc = subprocess.run([sys.executable, "-m", "maxbridge.cli", *args], capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, failure(proc.stderr)
  return proc.stdout


def test_shardings_table_is_the_same_on_both_backends():
  overrides = ("ici_fsdp_parallelism=4", "ici_tensor_parallelism=2")
  linen = maxbridge_cli("shardings", "--devices", "8", "llama-tiny", *overrides, *LINEN_ARGS)
  nnx = maxbridge_cli(
      "shardings",
      "--devices",
      "8",
      "llama-tiny",
      *overrides,
      "pure_nnx=true",
      "enable_nnx=true",
      "pure_nnx_decoder=false",
  )
  assert linen == nnx
  # The printout is what the sharding goldens hold (tests/test_sharding_goldens.py).
  assert linen == (Path(__file__).parent / "goldens" / "shardings" / "llama-tiny.fsdp4-tensor2.txt").read_text()
  mesh = linen.splitlines()[0]
  assert mesh.startswith("mesh: diloco=1 x data=1 x ") and "fsdp=4" in mesh and "tensor=2" in mesh, mesh
  row = next(line for line in linen.splitlines() if line.startswith("decoder/layers/mlp/wi_0/kernel"))
  assert "float32  embed, layers, mlp" in row and "P(('fsdp', 'context'), " in row and "'tensor')" in row, row
  # The last column is the bytes one device holds: the float32 kernel split 4 x 2 ways.
  shape = tuple(int(n) for n in row.split("(")[1].split(")")[0].split(",") if n.strip())
  assert int(row.split()[-1].replace(",", "")) == np.prod(shape) * 4 // 8, row
  # Adam's mu and nu: each as the kernel is.
  columns = {line.split()[0]: line.split()[1:] for line in linen.splitlines()[2:]}
  for moment in ("mu", "nu"):
    assert columns[f"opt_state/0/{moment}/params/decoder/layers/mlp/wi_0/kernel"] == row.split()[1:], linen
  totals = {label: int(size.replace(",", "")) for label, size in re.findall(r"^([a-z ]+): ([\d,]+) bytes", linen, re.M)}
  assert totals["total"] == totals["parameters"] + totals["optimizer state"] + totals["step"], linen
  assert totals["optimizer state"] == 2 * totals["parameters"] + 2 * 4, linen  # mu, nu and two int32 counts


def test_llama2_7b_train_step_compiles_for_eight_devices():
  out = maxbridge_cli(
      "compile",
      "--devices",
      "8",
      "llama2-7b",
      "per_device_batch_size=1",
      "max_target_length=2048",
      "remat_policy=full",
      *LINEN_ARGS,
  )
  assert "for 8 devices (diloco=1 x data=1 x stage=1 x fsdp=8 x context=1 x tensor=1 x expert=1)" in out
  # 6.74e9 parameters x (4 + 4 + 4 bytes: params, mu, nu) / 8 devices = 9.42 GiB.
  state = float(next(l for l in out.splitlines() if "parameters + optimizer state" in l).split()[-4])
  assert 9.3 < state < 9.5, out


@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_engine_decoding_on_a_2x2x2_mesh_equals_one_device_with_the_cache_sharded(report, backend):
  one, mesh = report["engine"][f"{backend}@1"], report["engine"][f"{backend}@2x2x2"]
  assert one["slots"] == mesh["slots"] == 8
  assert mesh["tokens"] == one["tokens"] == report["engine"]["linen@1"]["tokens"]
  np.testing.assert_allclose(mesh["logits"], one["logits"], atol=1e-5, rtol=1e-5)
  # Slots split over data x fsdp (x expert, size 1 here), kv heads over tensor; positions and segments follow the slots.
  slots = ("data", "fsdp", "expert")
  want = {
      "cached_key": PartitionSpec(slots, "tensor", None, None),
      "cached_value": PartitionSpec(slots, "tensor", None, None),
      "cache_positions": PartitionSpec(slots, None),
      "cache_segment_ids": PartitionSpec(slots, None),
      "cache_index": PartitionSpec(slots),
  }
  assert mesh["specs"] == {f"decoder/layers_0/self_attention/{k}": str(v) for k, v in want.items()}
  assert mesh["tokens_spec"] == str(PartitionSpec(slots))
