"""maxbridge: one decoder-only transformer in Flax Linen and Flax NNX, behind three flags."""
from maxbridge.config import Config, ConfigError, load_config
from maxbridge.dispatch import create_model
from maxbridge.model import Model
from maxbridge.train import train

__all__ = ["Config", "ConfigError", "Model", "create_model", "load_config", "train"]
