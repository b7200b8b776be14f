"""maxbridge: one decoder-only transformer in Flax Linen and Flax NNX, behind three flags."""

import importlib
import sys
import types
import typing

# Public name -> the module defining it, imported on first use: `import
# maxbridge.config` (the command line's first step) must not start JAX.
_PUBLIC = {
    "Config": "maxbridge.config",
    "ConfigError": "maxbridge.config",
    "load_config": "maxbridge.config",
    "Model": "maxbridge.model",
    "create_model": "maxbridge.dispatch",
    "Engine": "maxbridge.engine",
    "from_pretrained": "maxbridge.hf",
    "train": "maxbridge.train",
}

__all__ = list(_PUBLIC)

if typing.TYPE_CHECKING:  # what type checkers and editors read; at run time, __getattr__ below
  from maxbridge.config import Config, ConfigError, load_config
  from maxbridge.dispatch import create_model
  from maxbridge.engine import Engine
  from maxbridge.hf import from_pretrained
  from maxbridge.model import Model
  from maxbridge.train import train


def __getattr__(name: str):
  if name not in _PUBLIC:
    raise AttributeError(f"module 'maxbridge' has no attribute {name!r}")
  value = getattr(importlib.import_module(_PUBLIC[name]), name)
  globals()[name] = value
  return value


def __dir__() -> list[str]:
  return sorted({*globals(), *_PUBLIC})


class _Package(types.ModuleType):
  """`mb.train` is the function: the first import of the module `maxbridge.train` would bind the module."""

  def __setattr__(self, name: str, value) -> None:
    if name == "train" and isinstance(value, types.ModuleType):
      value = value.train
    super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
