"""Any checkpoint a user holds, read as (Config, canonical parameters) or as an `mb.Model`.

Ours (a run, its checkpoints or one step), MaxText's (with a config that
describes it), a LoRA run (its base with the adapters merged in: the base is
named by the run folder's `lora_base.json`, whose fingerprint is checked before
anything is merged) or a Hugging Face folder; and ours written back as a
Hugging Face folder (`export_hf`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import warnings
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from maxbridge.core import canonical, checkpointing, config_keys, layouts
from maxbridge.core.config import Config, load_config, override_values
from maxbridge.interop.hf import folders
from maxbridge.interop.hf.families import HF_CONFIG_SIDECAR, HFError
from maxbridge.models import dispatch
from maxbridge.models.lora import COLLECTION, REFERENCE_FILE, dequantize_base, merge, quantize_base


def load_checkpoint(
    path: str | os.PathLike, *overrides: str, config: str | os.PathLike | None = None, **kwargs: Any
) -> tuple[Config, dict]:
  """(Config, canonical params) of a maxbridge or MaxText checkpoint or run directory, in any layout.

  `config` (a preset name or YAML path) describes the model, in place of the
  run's config.yml: MaxText's checkpoints have none beside them.
  """
  if config is None and holds_adapters(path):  # a LoRA run: its base with the adapters merged in, a plain model
    _, params, run_config = merged_params(None, path)
    plain = ("lora_rank=0", "lora_weight_qtype=", "load_parameters_path=")
    return (
        load_config(str(checkpointing.find_config(checkpointing.resolve(path)[0])), *plain, *overrides, **kwargs),
        params,
    )
  if config is not None:
    cfg = load_config(os.fspath(config), *overrides, **kwargs)
    _agrees_with_run(cfg, config, path, overrides, kwargs)
    if not cfg.checkpoint_is_quantized:  # a quantized tree holds other leaves than the float model's
      # Here, where the user's choice of config is known (a later shape error could not name it), and
      # on the metadata: a wrong config is reported before gigabytes are read.
      try:
        canonical.check(checkpointing.stored_params(path), folders.abstract_params(cfg), cfg.param_scan_axis)
      except ValueError as e:
        raise HFError(f"config={os.fspath(config)!r} does not describe the checkpoint in {path}: {e}") from e
    return cfg, checkpointing.load_params(path)[0]
  params, info = checkpointing.load_params(path)
  config_file = checkpointing.find_config(info.items)
  if config_file is None:
    raise HFError(
        f"{path} has no config.yml beside its checkpoints (or in its run directory), so the model it holds "
        "cannot be rebuilt; say which model it is with a preset or YAML file: config='llama2-7b' "
        "(or config='path/to.yml') in Python, --config llama2-7b on the command line"
    )
  return load_config(str(config_file), *overrides, **kwargs), params


def _agrees_with_run(cfg: Config, config: str | os.PathLike, path, overrides, kwargs) -> None:
  """A `config` given for a checkpoint whose run has its own config.yml is taken only where it agrees with it on
  what the model computes: config.yml describes the checkpoints, and a config of the same shapes but, say,
  another RoPE base or epsilon would read them as another model. How the model runs (precision, kernel,
  layout) is the given config's."""
  found = checkpointing.find_config(checkpointing.resolve(path)[0])
  if found is None:  # MaxText's checkpoints have none: the given config describes them
    return
  differ = config_keys.contradictions(load_config(str(found), *overrides, **kwargs), cfg)
  if differ:
    raise HFError(
        f"config={os.fspath(config)!r} contradicts {found}, which describes the checkpoints in {path} "
        f"({'; '.join(differ[:8])}): drop the config (the run's own is read), or give one that agrees"
    )


def sidecar(path: str | os.PathLike) -> tuple[dict[str, Any] | None, Path | None]:
  """The original Hugging Face config.json kept by import-hf, and the folder it lies in."""
  config_file = checkpointing.find_config(checkpointing.resolve(path)[0])
  if config_file is None or not (config_file.parent / HF_CONFIG_SIDECAR).is_file():
    return None, None
  return json.loads((config_file.parent / HF_CONFIG_SIDECAR).read_text()), config_file.parent


def export_hf(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *,
    dtype: str | None = None,
    config: str | os.PathLike | None = None,
) -> Path:
  """Writes a maxbridge checkpoint as a Hugging Face folder (config.json + model.safetensors).

  `config`: a preset or YAML path, for a checkpoint without config.yml (MaxText's).
  """
  cfg, params = load_checkpoint(source, config=config)
  base, folder = sidecar(source)
  try:
    out = folders.save_hf(params, cfg, destination, dtype=dtype, base_config=base)
  except folders.ParamsDisagree as e:
    given = f"config={config!r}" if config is not None else "its config.yml"
    raise HFError(f"{source}: {given} does not describe its checkpoint; nothing was written. {e}") from e
  tokenizer = tokenizer_folder(source) or folder  # the run's (or import-hf's) tokenizer files, beside config.yml
  if tokenizer is not None:
    folders.copy_tokenizer_files(tokenizer, out)
  return out


def from_pretrained(
    path: str | os.PathLike, backend: str | None = None, *, config: str | os.PathLike | None = None, **overrides: Any
):
  """An `mb.Model` from a Hugging Face folder (config.json + safetensors) or a maxbridge or MaxText checkpoint.

  `backend` sets the three flags ("linen": all Linen, "nnx": all NNX). Left
  out, the model's config decides: a run's config.yml records the flags it
  trained with, and a Hugging Face folder or a preset takes base.yml's, NNX.
  Keyword `overrides` are config keys (e.g. `scan_layers=False`, or the flags
  themselves). `config` (a preset such as "llama2-7b", or a YAML path)
  describes a checkpoint that has no config.yml beside it, as MaxText's have none.
  """
  cfg, params = load_pretrained(path, config=config, **{**backend_overrides(backend), **overrides})
  return dispatch.create_model(cfg, params=params)


def backend_overrides(backend: str | None) -> dict[str, bool]:
  """The three flags of a named backend as config overrides; none for None, so the config's own stand."""
  return {} if backend is None else dispatch.backend_flags(backend)


def load_pretrained(
    path: str | os.PathLike, *overrides: str, config: str | os.PathLike | None = None, **kwargs: Any
) -> tuple[Config, dict]:
  """(Config, canonical params) of a Hugging Face folder or a maxbridge or MaxText checkpoint."""
  if folders.is_hf_folder(path):
    if config is not None:
      raise HFError(f"{path} is a Hugging Face folder: its config.json describes the model; drop config={config!r}")
    cfg, params = folders.load_hf(path, *overrides, **kwargs)
  elif Path(path).exists():
    cfg, params = load_checkpoint(path, *overrides, config=config, **kwargs)
  else:
    raise FileNotFoundError(f"{path}: no such Hugging Face folder or maxbridge checkpoint")
  named = "max_prefill_predict_length" in {**kwargs, **override_values(overrides)}
  if not named and cfg.max_prefill_predict_length >= cfg.max_target_length:
    # A run trained on short sequences (max_target_length=32 under the default prefill of 32) has no room to
    # generate: half its length is the prompt's. A prefill the user names is theirs, and refused where it cannot fit.
    cfg = cfg.replace(max_prefill_predict_length=max(1, cfg.max_target_length // 2))
  return cfg, params


def tokenizer_folder(path: str | os.PathLike) -> Path | None:
  """The folder holding `path`'s tokenizer.json: `path` itself (a Hugging Face folder, a run), or the folder of the
  config.yml its checkpoint belongs to (a run copies its `tokenizer_path` files there as it starts; import-hf
  copies the Hugging Face folder's)."""
  path = Path(path)
  if (path / "tokenizer.json").is_file():
    return path
  try:
    config_file = checkpointing.find_config(checkpointing.resolve(path)[0])
  except (ValueError, OSError):
    return None
  return config_file.parent if config_file is not None and (config_file.parent / "tokenizer.json").is_file() else None


@dataclasses.dataclass(frozen=True)
class TextTokenizer:
  """Text <-> token ids of a model: its tokenizer.json (`tokenizer`, a `tokenizers.Tokenizer`), or UTF-8 bytes as
  ids 0..255 (`tokenizer` None, the byte fallback). `folder` holds its files (tokenizer_config.json, chat
  template), None for bytes."""

  tokenizer: Any = None
  folder: Path | None = None

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """`text`'s ids, with the special tokens its tokenizer adds (a BOS, say) unless `add_special_tokens` is False."""
    if self.tokenizer is None:
      return list(text.encode("utf-8"))
    return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

  def token_strs(self, ids) -> list[str]:
    """Each id's own string in the vocabulary (byte-level BPE's "Ġthe"); for bytes, the byte as one Latin-1
    character, so that every id has one."""
    if self.tokenizer is None:
      return [bytes([int(t)]).decode("latin-1") if 0 <= t < 256 else "" for t in ids]
    return [self.tokenizer.id_to_token(int(t)) or "" for t in ids]

  def decode(self, ids) -> str:
    if self.tokenizer is None:
      return bytes(int(t) for t in ids if 0 <= t < 256).decode("utf-8", errors="replace")
    return self.tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)


def model_tokenizer(source: str | os.PathLike, vocab_size: int, tokenizer_path: str | None = None) -> TextTokenizer:
  """The one tokenizer of the model at `source`, as generate, serve and `Engine.from_pretrained` use it.

  `tokenizer_path` given (a folder, or "" for bytes) overrides it, refused when its ids do not fit
  `vocab_size`. Else the tokenizer.json of `source` (`tokenizer_folder`: a Hugging Face folder's, or the one a
  run copied beside its config.yml); a model without one is read as UTF-8 bytes, with a warning saying so.
  """
  if tokenizer_path:
    key = f"tokenizer_path={tokenizer_path!r}"
    return TextTokenizer(load_tokenizer(tokenizer_path, vocab_size, key=key), Path(tokenizer_path))
  folder = None if tokenizer_path is not None else tokenizer_folder(source)
  if folder is not None:
    return TextTokenizer(load_tokenizer(folder, vocab_size, key=f"{source}'s tokenizer"), folder)
  if vocab_size < 256:
    raise ValueError(f"no tokenizer.json in {source} and vocab_size={vocab_size} is too small for byte tokens")
  if tokenizer_path is None:
    warnings.warn(
        f"{source} has no tokenizer (no tokenizer.json in it or beside its config.yml): falling back to UTF-8 "
        "bytes as token ids 0..255 (the byte fallback); give tokenizer_path=FOLDER to use a tokenizer",
        stacklevel=2,
    )
  return TextTokenizer()


def load_tokenizer(folder: str | os.PathLike, vocab_size: int | None = None, key: str = "tokenizer"):
  """`folder`'s tokenizer.json as a `tokenizers.Tokenizer`, refused (naming the file and `key`, the setting that
  chose it) when it is unreadable or, given the model's `vocab_size`, makes ids the model has no embedding for."""
  path = Path(folder) / "tokenizer.json"
  if not path.is_file():
    raise FileNotFoundError(f"{key}: {path} does not exist; a tokenizer folder holds a tokenizer.json")
  try:
    from tokenizers import Tokenizer  # an optional package: only a folder with a tokenizer needs it
  except ImportError as e:
    raise ImportError(f"{key}: reading {path} needs the tokenizers package (pip install tokenizers)") from e
  try:
    tokenizer = Tokenizer.from_file(str(path))
  except Exception as e:  # the library raises a bare Exception for any file it cannot read, JSON or not
    raise HFError(f"{key}: {path} is not a tokenizer the tokenizers package can read: {e}") from e
  if vocab_size is not None:
    # Ids past the embedding table gather nothing the model learned: a nan loss, or silently wrong text.
    size = max(tokenizer.get_vocab(with_added_tokens=True).values(), default=-1) + 1
    if size > vocab_size:
      raise HFError(
          f"{key}: {path} makes token ids up to {size - 1}, but the model's vocab_size={vocab_size} has embeddings "
          f"for ids 0..{vocab_size - 1} only; use the model's own tokenizer, or a model with vocab_size >= {size}"
      )
  return tokenizer


# --- LoRA runs ---


def load_adapters(path: str | os.PathLike) -> tuple[dict, Config, dict | None]:
  """(adapter tree as stored, the run's config, its base reference) of a LoRA run, checkpoints or step folder."""
  # Read whole here: `CheckpointReader` maps parameter layouts, and an adapter tree is none of them.

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

  tree, run_config, reference = load_adapters(adapters)
  if base is None:
    if not run_config.load_parameters_path:
      raise checkpointing.CheckpointError(
          f"{adapters} was trained on a randomly initialised base ({reference and reference['base']}); "
          "there is no base checkpoint to apply its adapters to"
      )
    base = run_config.load_parameters_path
  base_config, params = load_pretrained(base)
  params = layouts.cast_floating(jax.device_get(params), np.dtype(run_config.weight_dtype))
  if run_config.lora_weight_qtype:
    quantized = run_config.replace(param_scan_axis=base_config.param_scan_axis)
    axes = dispatch.abstract_model(quantized).logical_axes()
    params = jax.device_get(dequantize_base(quantized, quantize_base(quantized, params, axes)))
  if reference is not None:
    found = canonical.fingerprint(params, base_config.param_scan_axis)
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
