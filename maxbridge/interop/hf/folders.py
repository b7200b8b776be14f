"""Hugging Face folders and maxbridge checkpoints on disk: read, write, import, export."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from maxbridge.core import canonical, checkpointing, files
from maxbridge.core.config import Config
from maxbridge.interop.hf.families import CONFIG_FILE, HF_CONFIG_SIDECAR, INDEX_FILE, WEIGHTS_FILE, HFError
from maxbridge.interop.hf.families import family_for_model_type
from maxbridge.models import dispatch
from maxbridge.models.model import LinenModel
from maxbridge.interop.hf.mapping import (
    LazyTensor,
    config_from_hf,
    config_to_hf,
    from_hf_tensors,
    stored_mtp_layers,
    to_hf_tensors,
    untie_a_stored_head,
)

# --- folders -----------------------------------------------------------------------------


def is_hf_folder(path: str | os.PathLike) -> bool:
  return (Path(path) / CONFIG_FILE).is_file()


def read_hf_config(path: str | os.PathLike) -> dict[str, Any]:
  file = Path(path) / CONFIG_FILE
  if not file.is_file():
    raise HFError(f"{path} is not a Hugging Face model folder: it has no {CONFIG_FILE}")
  try:
    config = json.loads(file.read_bytes().decode("utf-8"))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise HFError(f"{file} is not valid JSON: {e}") from e
  if not isinstance(config, dict):
    raise HFError(f"{file} must hold a JSON object of config fields, got a {type(config).__name__}")
  return config


def open_hf_tensors(path: str | os.PathLike) -> dict[str, LazyTensor]:
  """{name: lazy tensor} from model.safetensors or the shards a model.safetensors.index.json lists."""
  from safetensors import safe_open  # pylint: disable=import-outside-toplevel

  path = Path(path)
  index = path / INDEX_FILE
  if index.is_file():
    try:
      weight_map = json.loads(index.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise HFError(f"{index} is not valid JSON: {e}") from e
    weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
      raise HFError(f"{index} has no weight_map of tensor names to file names")
    files = sorted(set(weight_map.values()))
  elif (path / WEIGHTS_FILE).is_file():
    files = [WEIGHTS_FILE]
  else:
    raise HFError(f"{path} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}")
  tensors = {}
  for file in files:
    if not (path / file).is_file():
      raise HFError(f"{index} lists {file}, which is not in {path}")
    try:
      handle = safe_open(str(path / file), framework="flax")
    except Exception as e:  # safetensors raises its own SafetensorError for a damaged file
      raise HFError(f"{path / file} is not a readable safetensors file (truncated or damaged?): {e}") from e
    for name in handle.keys():
      tensors[name] = LazyTensor(handle, name)
  return tensors


def load_hf(path: str | os.PathLike, *overrides: str, **kwargs: Any) -> tuple[Config, dict[str, Any]]:
  """(Config, unscanned canonical params) for a Hugging Face folder."""
  kwargs.setdefault("model_name", Path(path).resolve().name)
  cfg = config_from_hf(read_hf_config(path), *overrides, **kwargs)  # a bad config.json is named before any tensor
  tensors = open_hf_tensors(path)
  tensors = _language_model_alone(cfg, read_hf_config(path), tensors, path)
  cfg = untie_a_stored_head(cfg, tensors)
  given = {text.partition("=")[0].strip() for text in overrides} | set(kwargs)
  if "mtp_num_layers" not in given:  # the MTP layers a folder stores (DeepSeek-V3's), which transformers leaves out
    cfg = cfg.replace(mtp_num_layers=stored_mtp_layers(cfg, tensors))
  params = from_hf_tensors(tensors, cfg, abstract_params(cfg), where=str(path))
  return cfg, params


def _language_model_alone(config: Config, hf_config: Mapping[str, Any], tensors: dict, path) -> dict:
  """A multimodal folder's tensors as its language model's alone where `config` asks for a text-only model."""
  family = family_for_model_type(hf_config.get("model_type"))
  if config.use_multimodal or family.language_model is None:
    return tensors
  text, dropped = family.language_model(tensors)
  logging.info(
      "%s: use_multimodal=false reads the language model of this %s alone; %d tensors of its vision tower and "
      "projector are left out",
      path,
      family.architecture,
      len(dropped),
  )
  return text


def abstract_params(config: Config) -> dict[str, Any]:
  """The canonical tree of `cfg`'s model as shapes and dtypes; nothing is computed."""
  # Every flag combination declares this tree; traced in pure Linen whatever the flags (NNX by default).
  linen = config.replace(**dispatch.backend_flags("linen"))
  return LinenModel(linen, dispatch.linen_transformer(linen), dispatch.sample_inputs(linen)).abstract_params()


def save_hf(
    params: Mapping[str, Any],
    config: Config,
    destination: str | os.PathLike,
    *,
    dtype: str | None = None,
    base_config: Mapping[str, Any] | None = None,
) -> Path:
  """Writes config.json + model.safetensors into a new folder `destination`, atomically."""
  from safetensors import SafetensorError  # pylint: disable=import-outside-toplevel
  from safetensors.flax import save_file  # pylint: disable=import-outside-toplevel

  destination = Path(destination)
  refuse_existing(destination)
  if dtype is not None:
    config = config.replace(weight_dtype=dtype)
  out_dtype = jnp.dtype(config.weight_dtype)
  # The folder must load: config.json says what the tensors are, so they must be what cfg says.
  try:
    canonical.check(params, abstract_params(config), config.param_scan_axis)
  except ValueError as e:
    raise ParamsDisagree(
        f"the parameters do not match their config ({config.decoder_block} {config.model_name}): {e}"
    ) from e
  params32 = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), dict(params))
  tensors = {name: jnp.asarray(value, out_dtype) for name, value in to_hf_tensors(params32, config).items()}
  hf_config = config_to_hf(config, base_config)

  def write(tmp: Path) -> None:
    try:
      save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
    except SafetensorError as e:  # safetensors reports a failed write (a full disk, a size limit) as its own error
      raise OSError(f"could not write {destination / WEIGHTS_FILE}: {e}; nothing was written") from e
    files.apply_umask(tmp / WEIGHTS_FILE, directory=False)  # safetensors creates it 0o600
    files.write_text(tmp / CONFIG_FILE, json.dumps(hf_config, indent=2, sort_keys=True) + "\n")

  return write_atomically(destination, write)


class ParamsDisagree(HFError):
  pass


def refuse_existing(destination: Path) -> None:
  if destination.exists() and (not destination.is_dir() or any(destination.iterdir())):
    raise FileExistsError(f"{destination} already exists and is not empty; choose a new folder")


def write_atomically(destination: str | os.PathLike, write: Callable[[Path], None]) -> Path:
  """Runs `write(tmp)` on a fresh folder beside `destination`, then renames it into place.

  A failure leaves nothing at `destination`; an existing non-empty folder is never touched.
  """
  destination = Path(destination)
  refuse_existing(destination)
  destination.parent.mkdir(parents=True, exist_ok=True)
  # Named for this process: the next run for `destination` removes it if a kill left it behind.
  tmp = files.temp_dir_beside(destination, "writing")
  try:
    write(tmp)
    if destination.exists():
      destination.rmdir()  # empty, checked above
    os.replace(tmp, destination)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return destination


# --- maxbridge checkpoints <-> Hugging Face folders ----------------------------------------

# Copied along by import-hf and export-hf (and into a run folder from its tokenizer_path as it starts), so
# `maxbridge generate` and `serve` find the tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "generation_config.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


def copy_tokenizer_files(source: Path, destination: Path) -> None:
  for name in TOKENIZER_FILES:
    if (source / name).is_file():
      shutil.copy2(source / name, destination / name)


def write_params_folder(
    destination: str | os.PathLike,
    params: Any,
    config: Config,
    *,
    hf_config: dict[str, Any] | None = None,
    tokenizer: Path | None = None,
    step: int = 0,
) -> Path:
  """Writes a params-only checkpoint (at `step`, as training lays it out) with its `config.yml`, atomically.

  `hf_config` is kept as `hf_config.json` for a faithful `export-hf` later; the
  tokenizer files found in the folder `tokenizer` are copied along, so
  `maxbridge generate` finds them.
  """

  def write(tmp: Path) -> None:
    checkpointer = checkpointing.Checkpointer(tmp)
    checkpointer.save(step, {"params": {"params": params}})
    checkpointer.wait()
    checkpointer.close()
    config.to_yaml(tmp / "config.yml")
    if hf_config is not None:
      files.write_text(tmp / HF_CONFIG_SIDECAR, json.dumps(hf_config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
      copy_tokenizer_files(tokenizer, tmp)

  return write_atomically(destination, write)


def import_hf(
    source: str | os.PathLike,
    destination: str | os.PathLike,
    *overrides: str,
    scan_layers: bool | None = None,
    dtype: str | None = None,
) -> Path:
  """Writes a params-only maxbridge checkpoint of a Hugging Face folder into a new `destination`.

  `destination` holds `0/items` ({"params": {"params": tree}}, orbax, as
  training writes), `config.yml`, and the original config.json as
  `hf_config.json` (with the tokenizer files) for a faithful export later.
  """
  source, destination = Path(source), Path(destination)
  kwargs: dict[str, Any] = {}
  if scan_layers is not None:
    kwargs["scan_layers"] = scan_layers
  if dtype is not None:
    kwargs["weight_dtype"] = dtype
  cfg, params = load_hf(source, *overrides, **kwargs)
  if cfg.scan_layers:
    params = canonical.stack_layers(params, cfg.param_scan_axis)
  return write_params_folder(destination, params, cfg, hf_config=read_hf_config(source), tokenizer=source)
