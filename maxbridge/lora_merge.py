"""Merging a LoRA run's adapters into its base: `maxbridge lora-merge`, and loading a run to serve it.

A LoRA run's checkpoints hold only its adapters (`maxbridge/lora.py`); its
base is named by the run folder's `lora_base.json`, whose fingerprint is
checked here before anything is merged.
"""

import json
import os
from pathlib import Path

import jax
import numpy as np

from maxbridge import canonical, checkpointing, layouts
from maxbridge.config import Config
from maxbridge.lora import COLLECTION, REFERENCE_FILE, dequantize_base, fingerprint, merge, quantize_base


def load_adapters(path: str | os.PathLike) -> tuple[dict, Config, dict | None]:
  """(adapter tree as stored, the run's config, its base reference) of a LoRA run, checkpoints or step folder."""
  # Read whole here: `CheckpointReader` maps parameter layouts, and an adapter tree is none of them.
  import orbax.checkpoint as ocp  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel

  from maxbridge.config import load_config  # pylint: disable=import-outside-toplevel

  items, _ = checkpointing.resolve(path)
  handler = ocp.PyTreeCheckpointHandler()
  stored = handler.metadata(epath.Path(items.absolute())).tree
  if COLLECTION not in (stored.get("params") or {}):
    raise checkpointing.CheckpointError(f"{items} holds no adapters (params/{COLLECTION}): it is not a LoRA run's")
  item = {"params": {COLLECTION: stored["params"][COLLECTION]}}
  restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
  restored = handler.restore(
      epath.Path(items.absolute()),
      args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
  )
  config_file = checkpointing.find_config(items)
  if config_file is None:
    raise checkpointing.CheckpointError(
        f"{items}: no config.yml in its run directory, so lora_alpha/lora_rank are unknown"
    )
  reference_file = config_file.parent / REFERENCE_FILE
  reference = json.loads(reference_file.read_text()) if reference_file.is_file() else None
  return restored["params"][COLLECTION], load_config(str(config_file)), reference


def holds_adapters(path: str | os.PathLike) -> bool:
  """Whether `path` is a LoRA run, its checkpoints, a step or an items folder of them: a run folder holding
  config.yml and a base reference, at most three levels up (looked up without reading the checkpoint)."""
  path = Path(path).absolute()
  runs = [path, *list(path.parents)[:3]]
  return any((run / REFERENCE_FILE).is_file() and (run / "config.yml").is_file() for run in runs)


def base_and_adapters(base: str | os.PathLike | None, adapters: str | os.PathLike) -> tuple[Config, dict, dict, Config]:
  """(base config, the base as the run trained on it, the run's adapters, the run's config), both trees unscanned.

  `base` defaults to the run's own base (its `load_parameters_path`); it is
  checked against the fingerprint the run recorded. A QLoRA run's base is
  returned dequantized, as its adapters saw it.
  """
  from maxbridge import hf  # pylint: disable=import-outside-toplevel

  tree, run_config, reference = load_adapters(adapters)
  if base is None:
    if not run_config.load_parameters_path:
      raise checkpointing.CheckpointError(
          f"{adapters} was trained on a randomly initialised base ({reference and reference['base']}); "
          "there is no base checkpoint to apply its adapters to"
      )
    base = run_config.load_parameters_path
  base_config, params = hf.load_pretrained(base)
  params = layouts.cast_floating(jax.device_get(params), np.dtype(run_config.weight_dtype))
  if run_config.lora_weight_qtype:
    quantized = run_config.replace(param_scan_axis=base_config.param_scan_axis)
    params = jax.device_get(dequantize_base(quantized, quantize_base(quantized, params)))
  if reference is not None:
    found = fingerprint(params, base_config.param_scan_axis)
    if found != reference["fingerprint"]:
      raise checkpointing.CheckpointError(
          f"{adapters} was trained on base {reference['base']} (fingerprint {reference['fingerprint']}), "
          f"not on {base} (fingerprint {found}); give the base it was trained on"
      )
  unscanned = canonical.unstack_layers(params, base_config.param_scan_axis)
  return base_config, unscanned, canonical.unstack_layers(tree, run_config.param_scan_axis), run_config


def merged_params(base: str | os.PathLike | None, adapters: str | os.PathLike) -> tuple[Config, dict, Config]:
  """(base config, base + alpha/r * A @ B in the base's scan form, the run's config); see `base_and_adapters`."""
  base_config, params, tree, run_config = base_and_adapters(base, adapters)
  # Merged layer by layer, unscanned, then stacked when the base's config.yml says so.
  try:
    merged = jax.device_get(merge(run_config, params, tree))
  except ValueError as e:
    raise checkpointing.CheckpointError(f"{adapters} does not fit {base or run_config.load_parameters_path}: {e}") from e
  if base_config.scan_layers:  # (a Hugging Face folder reads unscanned)
    merged = canonical.stack_layers(merged, base_config.param_scan_axis)
  return base_config, merged, run_config


def merge_checkpoint(base: str | os.PathLike, adapters: str | os.PathLike, destination: str | os.PathLike) -> Path:
  """Writes base + alpha/r * A @ B as a plain params-only checkpoint (with config.yml) in a new `destination`.

  `base`: the Hugging Face folder or checkpoint the adapters were trained on
  (checked against the run's fingerprint); `adapters`: a LoRA run (its latest
  step), checkpoints or step folder. The result loads, trains, generates and
  exports (`export-hf`) like any checkpoint.
  """
  from maxbridge import hf  # pylint: disable=import-outside-toplevel
  from maxbridge.hf import folders  # pylint: disable=import-outside-toplevel

  folders._refuse_existing(Path(destination))  # pylint: disable=protected-access  # before any reading
  base_config, merged, _ = merged_params(base, adapters)
  if hf.is_hf_folder(base):
    sidecar, folder = hf.read_hf_config(base), Path(base)
  else:
    sidecar, folder = folders._sidecar(base)  # pylint: disable=protected-access

  return folders.write_params_folder(destination, merged, base_config, hf_config=sidecar, tokenizer=folder)
