"""Multi-token prediction (DeepSeek-V3, MaxText's `multi_token_prediction.py`): the shifts both backends share.

Module k (1-based) of `mtp_num_layers` reads, at position i, the previous
module's hidden state at i and the embedding of token i + k, and predicts token
i + k + 1: `targets` shifted left by k. Positions whose shifted index runs
past the sequence are masked out of the loss. Their positions must keep them
from every other row's attention, which masks by position: row i sits at
position i + k (its own plus k), later than every earlier row of its sequence.
Shifted as the tokens are (MaxText's roll), the rows past the end took
position 0, which every query sees: each row attended to the last rows, whose
hidden states had read its targets.
"""

import jax
import jax.numpy as jnp


def shift_left(x: jax.Array, k: int) -> jax.Array:
  """[B, T, ...] -> the same shape, position i holding x[:, i + k], zeros past the end (MaxText's roll_and_mask)."""
  if k == 0:
    return x
  return jnp.roll(x, -k, axis=1).at[:, -k:].set(0)


def module_inputs(embedded: jax.Array, positions: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Module k's token embeddings and positions: the embedding of token i + k, at position i's plus k (see above)."""
  return shift_left(embedded, k), positions + k


def module_targets(
    targets: jax.Array, targets_segmentation: jax.Array, inputs_segmentation: jax.Array, k: int
) -> tuple[jax.Array, jax.Array]:
  """(targets [B, T], float32 weights [B, T]) of module k: token i + k + 1, where it is a real target.

  Also masked where token i + k + 1 lies in another packed sequence than position i:
  MaxText's mask checks only that the shifted target is not padding.
  """
  same_sequence = shift_left(inputs_segmentation, k) == inputs_segmentation
  weights = (shift_left(targets_segmentation, k) != 0) & same_sequence
  return shift_left(targets, k), weights.astype(jnp.float32)
