"""`maxbridge lora-merge`: a LoRA run's adapters merged into its base, written as a plain checkpoint.

A LoRA run's checkpoints hold only its adapters (`maxbridge.models.lora`); its
base and the fingerprint checked before anything is merged are read by
`maxbridge.interop.pretrained`.
"""

import os
from pathlib import Path

from maxbridge.core import checkpointing
from maxbridge.interop import pretrained
from maxbridge.interop.hf import folders


def merge_checkpoint(base: str | os.PathLike, adapters: str | os.PathLike, destination: str | os.PathLike) -> Path:
  """Writes base + alpha/r * A @ B as a plain params-only checkpoint (with config.yml) in a new `destination`.

  `base`: the Hugging Face folder or checkpoint the adapters were trained on
  (checked against the run's fingerprint); `adapters`: a LoRA run (its latest
  step), checkpoints or step folder. The result loads, trains, generates and
  exports (`export-hf`) like any checkpoint.
  """
  folders.refuse_existing(Path(destination))  # before any reading
  base_config, merged, _ = pretrained.merged_params(base, adapters)
  if folders.is_hf_folder(base):
    sidecar, folder = folders.read_hf_config(base), Path(base)
  else:
    sidecar, folder = pretrained.sidecar(base)

  step = checkpointing.resolve(adapters)[1] or 0  # the adapters' step labels the merged model
  return folders.write_params_folder(destination, merged, base_config, hf_config=sidecar, tokenizer=folder, step=step)
