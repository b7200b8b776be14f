"""Images for a model with a vision tower, without a hub: decode, resize, rescale, normalise, and the prompt's
image placeholders expanded to the image tokens the model fills in.

As Hugging Face's Gemma3ImageProcessor (its Pillow backend, `Gemma3ImageProcessorPil`) computes: RGB, a bilinear
resize to the processor's size, times rescale_factor, then (x - image_mean) / image_std per channel. The
processor's settings come from the model folder's `preprocessor_config.json` when it has one; otherwise the
class's defaults, at the size the model's tower takes (`image_size_for_vit`). Pan-and-scan crops are refused.
"""

from __future__ import annotations

import io
import json
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

PREPROCESSOR_FILE = "preprocessor_config.json"
# Gemma3ImageProcessor's defaults (transformers' IMAGENET_STANDARD_MEAN / _STD, BILINEAR = 2).
DEFAULTS = {
    "do_convert_rgb": True,
    "do_resize": True,
    "resample": 2,
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
# Gemma 3's tokenizer's strings for the tokens around and inside an image (Gemma3Processor's full_image_sequence).
GEMMA3_TOKENS = ("<start_of_image>", "<image_soft_token>", "<end_of_image>")


class ImageError(ValueError):
  """An image or an image processor setting that cannot be used; the message names it."""


def processor_settings(folder: str | os.PathLike | None, image_size: int) -> dict[str, Any]:
  """The image processor's settings: `folder`'s preprocessor_config.json over the defaults (at `image_size`)."""
  settings = {**DEFAULTS, "size": {"height": image_size, "width": image_size}}
  file = None if folder is None else Path(folder) / PREPROCESSOR_FILE
  if file is not None and file.is_file():
    try:
      given = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ImageError(f"{file} is not valid JSON: {e}") from e
    if not isinstance(given, dict):
      raise ImageError(f"{file} must hold a JSON object")
    settings.update({key: value for key, value in given.items() if value is not None})
    if settings.get("do_pan_and_scan"):
      raise ImageError(f"{file}: do_pan_and_scan=true (crops of one image) is not supported; set it to false")
  size = settings["size"]
  if not isinstance(size, Mapping) or {"height", "width"} - set(size):
    raise ImageError(f"{PREPROCESSOR_FILE}: size={size!r} must give height and width")
  return settings


def decode(data: bytes | str | os.PathLike, max_pixels: int | None = None) -> Any:
  """A Pillow image from a file's path or its bytes; an ImageError naming what is wrong otherwise. `max_pixels`:
  a larger image is refused from its header, before its pixels are decompressed."""
  from PIL import Image, UnidentifiedImageError  # pylint: disable=import-outside-toplevel

  name = "these bytes" if isinstance(data, bytes) else data
  source = io.BytesIO(data) if isinstance(data, bytes) else data
  try:
    image = Image.open(source)
    if max_pixels is not None and image.width * image.height > max_pixels:
      raise ImageError(f"{name} is an image of {image.width}x{image.height} pixels, more than {max_pixels} an image may")
    image.load()
  except (UnidentifiedImageError, OSError, Image.DecompressionBombError) as e:
    raise ImageError(f"{name} is not an image Pillow can read: {e}") from e
  return image


def preprocess(image: Any, settings: Mapping[str, Any]) -> np.ndarray:
  """A Pillow image (or [H, W, C] uint8 array) -> float32 [height, width, C], as the processor computes it."""
  from PIL import Image  # pylint: disable=import-outside-toplevel

  if isinstance(image, np.ndarray):
    image = Image.fromarray(image)
  if settings["do_convert_rgb"] and image.mode != "RGB":
    image = image.convert("RGB")
  if settings["do_resize"]:
    size = settings["size"]
    image = image.resize((int(size["width"]), int(size["height"])), resample=int(settings["resample"]))
  pixels = np.asarray(image)
  if pixels.ndim == 2:
    pixels = pixels[..., None]
  pixels = pixels.astype(np.float64)
  if settings["do_rescale"]:
    pixels = pixels * float(settings["rescale_factor"])
  pixels = pixels.astype(np.float32)
  if settings["do_normalize"]:
    mean = np.asarray(settings["image_mean"], np.float32)
    std = np.asarray(settings["image_std"], np.float32)
    pixels = (pixels - mean) / std
  return pixels.astype(np.float32)


def load_images(
    sources: Sequence[bytes | str | os.PathLike], *, image_size: int, folder: str | os.PathLike | None = None
) -> np.ndarray:
  """Images (paths or bytes) -> float32 [N, image_size, image_size, C], ready for one row of `images`."""
  settings = processor_settings(folder, image_size)
  pixels = [preprocess(decode(source), settings) for source in sources]
  for source, image in zip(sources, pixels):
    if image.shape[:2] != (image_size, image_size):
      raise ImageError(
          f"{PREPROCESSOR_FILE}: size {image.shape[1]}x{image.shape[0]} does not match the model's "
          f"image_size_for_vit={image_size}"
      )
  return np.stack(pixels) if pixels else np.zeros((0, image_size, image_size, 3), np.float32)


def expand_placeholders(text: str, placeholder: str, tokens_per_image: int, tokens: Sequence[str] = GEMMA3_TOKENS) -> str:
  """The prompt with each `placeholder` (the config's image_placeholder) replaced as Gemma3Processor does:
  "\\n\\n" + boi + image token x tokens_per_image + eoi + "\\n\\n"."""
  boi, image, eoi = tokens
  return text.replace(placeholder, f"\n\n{boi}{image * tokens_per_image}{eoi}\n\n")


def expand_image_tokens(ids: Sequence[int], *, boi: int, image: int, eoi: int, tokens_per_image: int) -> list[int]:
  """Token ids with each `boi` (an image's place, as a tokenized placeholder gives it) followed by its image tokens
  and `eoi`, for a caller that holds ids rather than text."""
  out: list[int] = []
  for token in ids:
    out += [boi, *[image] * tokens_per_image, eoi] if token == boi else [token]
  return out
