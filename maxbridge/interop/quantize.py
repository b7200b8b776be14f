"""`maxbridge quantize`: a float checkpoint written again as a serve checkpoint (see `maxbridge.ops.quantization`)."""

import os
from pathlib import Path

from maxbridge.core import checkpointing
from maxbridge.core.config import ConfigError, available_presets, load_config
from maxbridge.interop import pretrained
from maxbridge.interop.hf import folders
from maxbridge.models import dispatch
from maxbridge.ops import quantization


def quantize_checkpoint(
    source: str | os.PathLike, destination: str | os.PathLike, *overrides: str, config: str | None = None
) -> Path:
  """`maxbridge quantize`: a float checkpoint -> a new serve checkpoint (`checkpoint_is_quantized=true`).

  `source` is a maxbridge checkpoint or run, an imported Hugging Face folder,
  a MaxText checkpoint (with `config`), or a preset / YAML file whose
  `load_parameters_path` names the float parameters. `overrides` must set
  `quantization`. `destination` gets `0/items` and `config.yml`, written into
  a temporary folder and renamed into place: any error leaves nothing.
  """
  given = any(o.startswith("quantization=") and o != "quantization=" for o in overrides)
  if not Path(source).exists() and os.fspath(source) not in available_presets():
    # Say what is missing: a folder that is not there reads as an unknown preset to load_config.
    raise FileNotFoundError(
        f"{source}: no such checkpoint, run or Hugging Face folder (nor a preset: {', '.join(available_presets())})"
    )
  if Path(source).is_dir():
    cfg, params = pretrained.load_pretrained(source, *overrides, config=config)
    step = 0 if folders.is_hf_folder(source) else checkpointing.resolve(source)[1]
  else:
    cfg = load_config(os.fspath(source), *overrides)
    if not cfg.load_parameters_path:
      raise ConfigError(f"{source} is a config without load_parameters_path: give the float checkpoint to quantize")
    params = checkpointing.load_params(cfg.load_parameters_path)[0]
    step = checkpointing.resolve(cfg.load_parameters_path)[1]
  if quantization.is_serve_tree(params) or (cfg.checkpoint_is_quantized and not given):
    raise ValueError(f"{source} is already quantized (checkpoint_is_quantized): quantize its float checkpoint")
  if not cfg.quantization:
    raise ConfigError("maxbridge quantize needs quantization=int8 (AQT; add use_qwix_quantization=true for Qwix)")
  serve = cfg.replace(checkpoint_is_quantized=True, load_parameters_path="", load_full_state_path="")
  serve_params = dispatch.quantize_params(serve, params)
  tokenizer = pretrained.tokenizer_folder(source) if Path(source).is_dir() else None

  # The source's step labels the result (a LoRA run's: the step its adapters were saved at).
  return folders.write_params_folder(destination, serve_params, serve, tokenizer=tokenizer, step=step or 0)
