"""maxbridge: one decoder-only transformer in Flax Linen and Flax NNX, behind three flags."""

import importlib
import typing

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
