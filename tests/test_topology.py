"""Compiling for a TPU slice this host lacks (`compile_topology`, libtpu's compiler on this CPU), and host offload.

libtpu is a test dependency (`maxbridge[tpu]`), so these run wherever the suite does.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest
from conftest import LINEN, LINEN_ARGS, failure, flag_id, tiny_config

from maxbridge.core.config import ConfigError
from maxbridge.training import topology

NNX = (True, True, True)


# Runs in a subprocess with XLA's default flags: the suite's -O0 (conftest) reaches the TPU compiler too, and its
# memory figures are the optimised program's only at the default.
_COMPILE = """
import json, sys
import maxbridge as mb
from maxbridge.training import aot
print(json.dumps([aot.compile_train_step(mb.load_config("llama-tiny", *o)) for o in json.loads(sys.argv[1])]))
"""


def compiled(*overrides: list[str]) -> list[dict]:
  """`aot.compile_train_step` of llama-tiny with each list of key=value overrides, as a user's compile runs."""
  env = {key: value for key, value in os.environ.items() if key != "XLA_FLAGS"}
  proc = subprocess.run(
      [sys.executable, "-c", _COMPILE, json.dumps(overrides)], capture_output=True, text=True, timeout=900, env=env
  )
  assert proc.returncode == 0, failure(proc.stderr)
  return json.loads(proc.stdout.splitlines()[-1])


def compile_cli(*args: str) -> subprocess.CompletedProcess:
  return subprocess.run(
      [sys.executable, "-m", "maxbridge.cli", "compile", *args], capture_output=True, text=True, timeout=600
  )


@pytest.mark.parametrize(
    "name, shape, chips",
    [
        ("v5p-8", (2, 2, 1), 4),
        ("v5p-16", (2, 2, 2), 8),
        ("v5p-128", (4, 4, 4), 64),
        ("v4-32", (2, 2, 4), 16),
        ("v5e-1", (1, 1), 1),
        ("v6e-8", (2, 4), 8),
        ("v5e-16", (4, 4), 16),
        ("v6e-256", (16, 16), 256),
    ],
)
def test_slice_names_are_maxtexts(name, shape, chips):
  spec = topology.target(tiny_config(compile_topology=name))
  assert (spec.shape, spec.chips) == (shape, chips)
  assert len(topology.devices(spec)) == chips


@pytest.mark.parametrize("name", ["v5p-4", "v6e-12", "v7-8", "tpu-8", "v5p"])
def test_a_name_that_is_no_slice_is_refused_with_the_valid_forms(name):
  with pytest.raises(ConfigError, match=rf"compile_topology='{name}' names no TPU slice: v4-N or v5p-N"):
    topology.target(tiny_config(compile_topology=name))


def test_a_run_refuses_compile_topology():
  from maxbridge.training import loop

  with pytest.raises(ConfigError, match="compile_topology='v5p-8' is for `maxbridge compile`"):
    loop.train(tiny_config(compile_topology="v5p-8", steps=1))


@pytest.mark.parametrize("flags", [LINEN_ARGS, []], ids=["linen", "nnx"])
def test_a_train_step_compiles_for_a_v5p_slice_and_host_offload_moves_the_state_off_hbm(flags):
  common = ["compile_topology=v5p-8", "per_device_batch_size=2", *flags]
  offload = ["parameter_memory_host_offload=true", "optimizer_memory_host_offload=true"]
  plain, offloaded = compiled(common, common + offload)
  assert (plain["devices"], plain["device_kind"], plain["mesh"]["fsdp"]) == (4, "TPU v5", 4)
  assert plain["host_bytes"] == 0 and plain["peak_bytes"] > 0 and plain["bytes_accessed"] > 0
  # The state (parameters, Adam's two moments) lives in host memory between steps: the step's HBM arguments
  # lose it, and the host holds it.
  assert offloaded["host_bytes"] >= plain["state_bytes"] > 0, offloaded
  assert offloaded["argument_bytes"] <= plain["argument_bytes"] - plain["state_bytes"], (plain, offloaded)


def test_a_step_too_big_for_the_chip_gets_the_compilers_verdict_and_how_far_over():
  # Llama 2 7B cut to 4 layers: 1.07e9 parameters, 16 GiB of float32 parameters and Adam moments on one
  # 16 GiB v5e chip.
  result = compile_cli("llama2-7b", "compile_topology=v5e-1", "base_num_decoder_layers=4", "max_target_length=512")
  assert result.returncode == 1, result.stdout + result.stderr[-3000:]
  match = re.search(r"needs ([\d.]+) GiB of HBM per chip, ([\d.]+) GiB available \(([\d.]+) GiB over\)", result.stdout)
  assert match, result.stdout
  needed, available, over = map(float, match.groups())
  assert needed > 16 > available > 15 and over == pytest.approx(needed - available, abs=0.02), result.stdout
  assert "The TPU compiler: RESOURCE_EXHAUSTED" in result.stdout, result.stdout


@pytest.mark.parametrize("flags", [LINEN, NNX], ids=flag_id)
def test_a_run_with_its_state_offloaded_to_host_memory_trains_and_resumes_as_one_without(flags, tmp_path):
  from maxbridge.training import loop

  def losses(run_name, **offload):
    config = tiny_config(flags, base_output_directory=str(tmp_path), run_name=run_name, steps=3, **offload)
    first = loop.train(config, until_step=2, progress=False)  # a checkpoint of the offloaded state, restored below
    return [record["loss"] for record in first + loop.train(config, progress=False)]

  offloaded = losses("offloaded", parameter_memory_host_offload=True, optimizer_memory_host_offload=True)
  # Other programs (the copies in and out), so XLA may round a last bit differently.
  np.testing.assert_allclose(offloaded, losses("plain"), rtol=1e-6)
  assert len(offloaded) == 3


def test_shardings_plans_for_the_slices_chips_and_compile_refuses_two_targets():
  out = subprocess.run(
      [sys.executable, "-m", "maxbridge.cli", "shardings", "llama3.1-8b", "compile_topology=v5p-16"],
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert out.returncode == 0 and "fsdp=8" in out.stdout, out.stdout + out.stderr[-2000:]
  both = compile_cli("--devices", "8", "llama-tiny", "compile_topology=v5p-8")
  assert both.returncode != 0 and "--devices=8 and compile_topology=v5p-8: name one" in both.stderr, both.stderr


def test_the_offloading_remat_policy_moves_saved_activations_to_the_host_and_lowers_hbm_peak():
  # Wide and long enough that the layers' saved matmul results, not the logits, set the peak.
  common = ["compile_topology=v5p-8", "per_device_batch_size=8", "max_target_length=512", "base_emb_dim=256"]
  common += ["base_mlp_dim=1024", "base_num_decoder_layers=4"]
  minimal, offloaded = compiled(common + ["remat_policy=minimal"], common + ["remat_policy=minimal_offloaded"])
  assert minimal["host_bytes"] == 0 and offloaded["host_bytes"] > 0, offloaded
  assert offloaded["peak_bytes"] < 0.8 * minimal["peak_bytes"], (minimal, offloaded)


@pytest.mark.parametrize(
    "devices, tpu",
    [
        ({"0x1af4": "0x020000", "0x8086": "0x060000"}, False),  # virtio and a bridge: any cloud VM
        ({"0x1ae0": "0x020000", "0x1af4": "0x010000"}, False),  # Compute Engine's gVNIC: Google's, but a NIC
        ({"0x1ae0": "0x010802"}, False),  # Compute Engine's NVMe disk
        ({"0x1ae0": "0x120000", "0x8086": "0x060000"}, True),  # a processing accelerator of Google's
        ({"0x1ae0": "0xff0000"}, True),  # an older TPU, unclassed
    ],
)
def test_a_tpu_host_is_told_by_its_pci_devices_not_by_the_vendor_alone(tmp_path, monkeypatch, devices, tpu):
  import glob

  import maxbridge

  for i, (vendor, pci_class) in enumerate(devices.items()):
    (tmp_path / str(i)).mkdir()
    (tmp_path / str(i) / "vendor").write_text(f"{vendor}\n")
    (tmp_path / str(i) / "class").write_text(f"{pci_class}\n")
  real_glob = glob.glob
  monkeypatch.setattr(glob, "glob", lambda pattern: real_glob(str(tmp_path / "*" / "vendor")))
  assert maxbridge._has_tpu_chip() is tpu
