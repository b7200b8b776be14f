"""The attention mask, built from query and key positions and segment ids, and the score masked pairs get.

Its own module so that every kernel (`ops.attention`'s, `ops.flash_attention`'s) builds the same mask.
"""

import jax
import jax.numpy as jnp

# A large finite negative, not -inf: a fully masked row then gives a uniform
# softmax instead of NaNs that would poison the gradients.
MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)

# Segment ids carry an image group above this (`ops.vision.with_image_groups`): tokens of one image (group > 0) see
# each other both ways. Text is group 0, so text-only ids and masks are exactly as without images.
IMAGE_GROUP_STRIDE = 1 << 16


def attention_mask(
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    sliding_window_size: int = 0,
    chunk_size: int = 0,
) -> jax.Array:
  """Query [B, T] and key [B, S] segment ids and positions -> [B, 1, 1, T, S] boolean.

  Query i sees key j when both are in one segment and kv_pos[j] <= q_pos[i];
  with `sliding_window_size` W > 0, also q_pos[i] - kv_pos[j] < W (the last
  W positions, itself included), as Mistral and Hugging Face define it; with
  `chunk_size` C > 0 (Llama 4's chunked attention), also q_pos[i] // C ==
  kv_pos[j] // C: positions are cut into chunks of C and no query sees past
  its chunk's start, as Hugging Face's `create_chunked_causal_mask` does.
  Tokens of one image (`IMAGE_GROUP_STRIDE`) also see the later tokens of their image, still within the window
  (Hugging Face's Gemma 3: AND(window, OR(causal, same image))).
  """
  for name, q, kv in (("segment_ids", q_segment_ids, kv_segment_ids), ("positions", q_positions, kv_positions)):
    if q.ndim != 2 or kv.ndim != 2 or q.shape[0] != kv.shape[0]:
      raise ValueError(f"attention_mask: q_{name} {q.shape} and kv_{name} {kv.shape} must be [B, T] and [B, S]")
  if q_segment_ids.shape != q_positions.shape or kv_segment_ids.shape != kv_positions.shape:
    raise ValueError(
        f"attention_mask: segment ids and positions differ in shape: queries {q_segment_ids.shape} vs "
        f"{q_positions.shape}, keys {kv_segment_ids.shape} vs {kv_positions.shape}"
    )
  distance = q_positions[:, :, None] - kv_positions[:, None, :]  # [B, T, S]
  q_group, q_segment_ids = jnp.divmod(q_segment_ids, IMAGE_GROUP_STRIDE)
  kv_group, kv_segment_ids = jnp.divmod(kv_segment_ids, IMAGE_GROUP_STRIDE)
  visible = (distance >= 0) | ((q_group[:, :, None] == kv_group[:, None, :]) & (q_group[:, :, None] > 0))
  if sliding_window_size:
    visible &= distance < sliding_window_size
  if chunk_size:
    visible &= q_positions[:, :, None] // chunk_size == kv_positions[:, None, :] // chunk_size
  visible &= q_segment_ids[:, :, None] == kv_segment_ids[:, None, :]
  return visible[:, None, None]
