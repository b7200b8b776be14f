"""maxbridge: one decoder-only transformer in Flax Linen and Flax NNX, behind three flags."""

import glob
import importlib
import os
import typing


def _has_tpu_chip() -> bool:
  """Whether a Google PCI device (vendor 0x1ae0) other than a network or storage controller is attached: a TPU.

  Google's virtual NIC (gVNIC) and NVMe disks carry the same vendor on every Compute Engine VM, so the vendor
  alone would take any such VM for a TPU host. The class is read rather than matching TPU device ids, which a
  new chip would outdate. (JAX's own test, `jax._src.hardware_utils`, would start JAX on `import maxbridge`.)
  """
  for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
    with open(vendor) as f:
      if f.read().strip() != "0x1ae0":
        continue
    with open(os.path.join(os.path.dirname(vendor), "class")) as f:
      if not f.read().strip().startswith(("0x01", "0x02")):  # PCI classes 01: storage, 02: network
        return True
  return False


def _quiet_libtpu_off_tpu() -> None:
  """Keeps a run on a host without TPUs as it is when libtpu is installed (`maxbridge[tpu]`, which compiles for
  a TPU topology from any host): JAX tries every installed plugin when its backends start, and libtpu, finding
  no TPU VM metadata to name its workers and chip, logs errors to stderr. A TPU VM's metadata would name them;
  here they are named for it (any chip: a compile names its own slice). A TPU host is left to libtpu.
  """
  if _has_tpu_chip():
    return
  os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
  # libtpu's lockfile guards a host's chips; with none, it would only keep two compiles apart.
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")


_quiet_libtpu_off_tpu()

# Public name -> the module defining it, imported on first use: `import
# maxbridge.core.config` (the command line's first step) must not start JAX.
_PUBLIC = {
    "Config": "maxbridge.core.config",
    "ConfigError": "maxbridge.core.config",
    "load_config": "maxbridge.core.config",
    "Model": "maxbridge.models.model",
    "create_model": "maxbridge.models.dispatch",
    "Engine": "maxbridge.serving.engine",
    "from_pretrained": "maxbridge.interop.pretrained",
    "train": "maxbridge.training.loop",
}

__all__ = list(_PUBLIC)

if typing.TYPE_CHECKING:  # what type checkers and editors read; at run time, __getattr__ below
  from maxbridge.core.config import Config, ConfigError, load_config
  from maxbridge.models.dispatch import create_model
  from maxbridge.serving.engine import Engine
  from maxbridge.interop.pretrained import from_pretrained
  from maxbridge.models.model import Model
  from maxbridge.training.loop import train


def __getattr__(name: str):
  if name not in _PUBLIC:
    raise AttributeError(f"module 'maxbridge' has no attribute {name!r}")
  value = getattr(importlib.import_module(_PUBLIC[name]), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *_PUBLIC})
