"""A chat's messages as the chat template and the prefill take them: content parts (OpenAI's `content: [...]`)
flattened to text, and the images of `image_url` parts for a model with a vision tower.

Text parts join with newlines, as vLLM renders content for a template that takes strings. An image part becomes
the config's image_placeholder in that text, expanded after rendering to the image's tokens, as `maxbridge
generate --image` expands it (`interop.images`); its pixels go to the prefill, image after image. Images come
inline, as `data:` URLs: the server fetches nothing over the network.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import os
import re
from typing import Any, Sequence

import jinja2
import numpy as np

from maxbridge.core.config import Config
from maxbridge.interop import images as image_io
from maxbridge.serving import codec as codec_lib
from maxbridge.serving import openai_api as api

_DATA_URL = re.compile(r"data:image/[\w.+-]+;base64,(.*)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class Vision:
  """What a served model with a tower needs to take images: its placeholder, tokens per image, processor."""

  placeholder: str
  tokens_per_image: int
  settings: dict[str, Any]

  @classmethod
  def of(cls, config: Config, folder: str | os.PathLike | None) -> Vision | None:
    """None for a text-only model; `folder`'s preprocessor_config.json, if it has one, sets the processor."""
    if not config.use_multimodal:
      return None
    settings = image_io.processor_settings(folder, config.image_size_for_vit)
    return cls(config.image_placeholder, config.vision_output_length, settings)


def flatten(messages: Sequence[api.Message], placeholder: str | None) -> tuple[list[dict], list[tuple[str, str]]]:
  """(the messages with each content a string, what the chat template renders; each image part's URL and the field
  naming it, in order). `placeholder` None: the model takes no images, and an image part is refused naming it."""
  flat, urls = [], []
  for i, message in enumerate(messages):
    content = message.content
    if not isinstance(content, str):
      texts = []
      for j, part in enumerate(content):
        if isinstance(part, api.TextPart):
          texts.append(part.text)
          continue
        field = f"messages.{i}.content.{j}"
        if placeholder is None:
          raise api.Refusal(400, f"{field}: an image_url part, but this model has no vision tower (text only)", field)
        texts.append(placeholder)
        urls.append((part.image_url.url, f"{field}.image_url.url"))
      content = "\n".join(texts)
    flat.append({**message.model_dump(), "content": content})
  return flat, urls


def read_image(url: str, field: str) -> bytes:
  """The bytes of a `data:image/...;base64,` URL; anything else refused naming `field`."""
  match = _DATA_URL.fullmatch(url)
  if match is None:
    shown = url if len(url) <= 60 else url[:57] + "..."
    raise api.Refusal(
        400,
        f"{field}: {shown!r} is not a data:image/...;base64, URL; this server reads images inline and fetches "
        "nothing over the network",
        field,
    )
  try:
    return base64.b64decode(match.group(1), validate=True)
  except binascii.Error as e:
    raise api.Refusal(400, f"{field}: its base64 data cannot be decoded: {e}", field) from e


def chat_prompt(
    template: jinja2.Template | None,
    codec: codec_lib.Codec,
    messages: Sequence[api.Message],
    vision: Vision | None,
    *,
    add_generation_prompt: bool = True,
    read_images: bool = True,
) -> tuple[list[int], np.ndarray | None]:
  """(the rendered chat's tokens, its images preprocessed [N, H, W, C] or None). With `read_images` false
  (/tokenize) the tokens only: each image's tokens are counted, its data not decoded."""
  if template is None:
    raise api.Refusal(
        400,
        "this model has no chat template (tokenizer_config.json's chat_template in its tokenizer folder): "
        "use /v1/completions",
        "messages",
    )
  flat, urls = flatten(messages, None if vision is None else vision.placeholder)
  try:
    text = template.render(messages=flat, add_generation_prompt=add_generation_prompt, **codec.special_tokens)
  except jinja2.exceptions.TemplateError as e:
    raise api.Refusal(400, f"the chat template refused these messages: {e}", "messages") from e
  if not urls:
    return codec.encode(text), None
  found = text.count(vision.placeholder)
  if found != len(urls):  # the text itself spelled the placeholder, or the template dropped a message's content
    raise api.Refusal(
        400,
        f"the rendered chat holds {found} image placeholders ({vision.placeholder!r}) for {len(urls)} image_url "
        "parts: give the placeholder only through image parts",
        "messages",
    )
  tokens = codec.encode(image_io.expand_placeholders(text, vision.placeholder, vision.tokens_per_image))
  if not read_images:
    return tokens, None
  pixels = []
  for url, field in urls:
    try:
      pixels.append(image_io.preprocess(image_io.decode(read_image(url, field)), vision.settings))
    except image_io.ImageError as e:
      raise api.Refusal(400, f"{field}: {e}", field) from e
  return tokens, np.stack(pixels)
