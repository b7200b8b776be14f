"""maxbridge: one decoder-only transformer in Flax Linen and Flax NNX, behind three flags."""

from maxbridge.config import Config, ConfigError, load_config
from maxbridge.dispatch import create_model
from maxbridge.hf import from_pretrained
from maxbridge.model import Model
from maxbridge.train import train

__all__ = ["Config", "ConfigError", "Model", "create_model", "from_pretrained", "load_config", "train"]
