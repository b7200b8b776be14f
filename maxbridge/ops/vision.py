"""A vision tower's math and how its image embeddings join the text: both backends' `vision` modules call these.

Gemma 3's tower is SigLIP (a ViT over square patches with learned positions,
pre-LN blocks and a GELU-tanh MLP), then its projector: the patch grid averaged
down to `vision_output_length` soft tokens, Gemma's RMSNorm and a linear map to
the text width. The soft tokens take the places of the prompt's image tokens,
and attend to one another in both directions (Hugging Face's `token_type_ids`
mask): the image's group rides in the segment ids (`with_image_groups`), which
`ops.attention_mask` reads.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxbridge.ops.attention_mask import IMAGE_GROUP_STRIDE


class MultimodalInput(NamedTuple):
  """MaxText's decoder input of that name: `images` float32 [B, N, H, W, C] (pixels already normalised); the
  optional `image_masks` [B, N] marks the real images of a row (a row with fewer images pads with zeros)."""

  images: jax.Array
  image_masks: jax.Array | None = None


def patches(images: jax.Array, patch_size: int) -> jax.Array:
  """[B, H, W, C] -> [B, (H/p) * (W/p), p, p, C], row by row: a stride-p convolution's windows, as a matmul reads
  them (its kernel [p, p, C, D] is the convolution's HWIO kernel)."""
  batch, height, width, channels = images.shape
  if height % patch_size or width % patch_size:
    raise ValueError(f"images of {height}x{width} pixels do not cut into {patch_size}x{patch_size} patches")
  rows, cols = height // patch_size, width // patch_size
  x = images.reshape(batch, rows, patch_size, cols, patch_size, channels)
  return x.transpose(0, 1, 3, 2, 4, 5).reshape(batch, rows * cols, patch_size, patch_size, channels)


def encoder_attention(query: jax.Array, key: jax.Array, value: jax.Array) -> jax.Array:
  """A ViT's attention: every patch sees every patch. [B, N, H, K] each -> [B, N, H, K]; softmax in float32."""
  scores = jnp.einsum("BQHK,BSHK->BHQS", query, key, preferred_element_type=jnp.float32) * query.shape[-1] ** -0.5
  weights = jax.nn.softmax(scores, axis=-1).astype(value.dtype)
  return jnp.einsum("BHQS,BSHK->BQHK", weights, value)


def gelu_tanh(x: jax.Array) -> jax.Array:
  """SigLIP's MLP activation (Hugging Face's gelu_pytorch_tanh)."""
  return jax.nn.gelu(x, approximate=True)


def average_pool(x: jax.Array, tokens: int) -> jax.Array:
  """[B, g * g, D] patch embeddings, row by row -> [B, tokens, D]: the g x g grid averaged over square windows to
  sqrt(tokens) x sqrt(tokens), row by row (Gemma 3's projector's AvgPool2d)."""
  batch, count, width = x.shape
  grid, side = round(count**0.5), round(tokens**0.5)
  if grid * grid != count or side * side != tokens or grid % side:
    raise ValueError(f"a grid of {count} patches does not pool evenly to {tokens} tokens (two squares, sides dividing)")
  window = grid // side
  pooled = x.reshape(batch, side, window, side, window, width).mean(axis=(2, 4), dtype=jnp.float32)
  return pooled.reshape(batch, tokens, width).astype(x.dtype)


def image_token_mask(tokens: jax.Array, image_token: int) -> jax.Array:
  """[B, T] bool: where the image embeddings go."""
  return tokens == image_token


def image_groups(tokens: jax.Array, image_token: int) -> jax.Array:
  """[B, T] int32: 0 on text, k on the k-th run of image tokens of a row (Hugging Face's block ids, plus one)."""
  is_image = image_token_mask(tokens, image_token)
  starts = is_image & ~jnp.pad(is_image, ((0, 0), (1, 0)))[:, :-1]
  return jnp.where(is_image, jnp.cumsum(starts, axis=1, dtype=jnp.int32), 0)


def with_image_groups(segment_ids: jax.Array, groups: jax.Array) -> jax.Array:
  """Segment ids that also carry each token's image group (`ops.attention_mask` reads both); unchanged on text."""
  return segment_ids + groups * IMAGE_GROUP_STRIDE


def merge_image_embeddings(embedded: jax.Array, is_image: jax.Array, image_embeddings: jax.Array) -> jax.Array:
  """Text embeddings [B, T, D] with the image tokens' replaced, in order, by a row's image embeddings [B, M, D]
  (its images' soft tokens, image after image): the k-th image token of a row takes its k-th embedding."""
  index = jnp.clip(jnp.cumsum(is_image, axis=1) - 1, 0, image_embeddings.shape[1] - 1)
  gathered = jnp.take_along_axis(image_embeddings, index[..., None], axis=1).astype(embedded.dtype)
  return jnp.where(is_image[..., None], gathered, embedded)


def check_images(images: jax.Array, *, image_size: int, channels: int) -> None:
  """A ValueError naming the shape unless `images` is float [B, N, image_size, image_size, channels]."""
  expected = f"[batch, images, {image_size}, {image_size}, {channels}] (image_size_for_vit, num_channels_for_vit)"
  if images.ndim != 5 or tuple(images.shape[2:]) != (image_size, image_size, channels):
    raise ValueError(f"multimodal_input.images has shape {tuple(images.shape)}; expected {expected}")
  if not jnp.issubdtype(images.dtype, jnp.floating):
    raise ValueError(f"multimodal_input.images must be floating point (normalised pixels), got {images.dtype}")


def check_placeholders(
    tokens: jax.Array, images: jax.Array, image_masks: jax.Array | None, *, image_token: int, tokens_per_image: int
) -> None:
  """A ValueError unless each row has exactly tokens_per_image image tokens per image it is given (checked on
  concrete arrays only: a traced call cannot look)."""
  if any(isinstance(x, jax.core.Tracer) for x in (tokens, image_masks) if x is not None):
    return
  placed = jnp.sum(image_token_mask(tokens, image_token), axis=1)
  given = jnp.full((images.shape[0],), images.shape[1]) if image_masks is None else jnp.sum(image_masks, axis=1)
  wanted = given * tokens_per_image
  for row, (have, want) in enumerate(zip(placed.tolist(), wanted.tolist())):
    if have != want:
      raise ValueError(
          f"row {row} of the tokens holds {have} image tokens (image_token_index={image_token}) for "
          f"{want // tokens_per_image} images of {tokens_per_image} tokens each (vision_output_length): "
          "each image needs its placeholder expanded to that many image tokens"
      )


def image_embeddings(encode, project, images: jax.Array) -> jax.Array:
  """images [B, N, H, W, C] -> each row's soft tokens, image after image [B, N * tokens, D]: `project(encode(x))`
  of the images as one batch."""
  batch, count = images.shape[:2]
  out = project(encode(images.reshape(batch * count, *images.shape[2:])))
  return out.reshape(batch, count * out.shape[1], out.shape[2])


def join_images(
    embedded: jax.Array, tokens: jax.Array, segment_ids: jax.Array, image_embeddings: jax.Array, image_token: int
) -> tuple[jax.Array, jax.Array]:
  """(embeddings with the images' in place, segment ids with the images' groups) for the decoder."""
  is_image = image_token_mask(tokens, image_token)
  merged = merge_image_embeddings(embedded, is_image, image_embeddings)
  return merged, with_image_groups(segment_ids, image_groups(tokens, image_token))
