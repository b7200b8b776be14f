"""Vocabulary tiling: the training loss without ever holding the full [B, T, V] logits.

The final hidden states [B, T, D] are cut into `num_tiles` row tiles. A
`jax.custom_vjp` loss scans the tiles, computing each tile's logits with the
model's own output head and keeping only float32 sums. When differentiated,
the same scan also takes each tile's gradient under `jax.vjp` while its logits
are at hand, accumulating the head's parameter gradients and keeping the
hidden-state gradient; the backward pass only scales them by the cotangent.
Peak memory holds one tile's logits, not all of them.

Written by hand because JAX's autodiff of a `lax.scan` would save every
tile's logits (or their softmax) as residuals for the backward pass, which is
exactly the [B, T, V] buffer tiling exists to avoid.
"""

import functools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.core import sharding
from maxbridge.core.config import Config, ConfigError
from maxbridge.training.loss import CrossEntropy, Forward
from maxbridge.ops import linear, losses, output_head

# head(trainable, frozen, hidden [rows, D]) -> float32 logits [rows, V]
Head = Callable[[Any, Any, jax.Array], jax.Array]
# tile_loss(trainable, frozen, hidden [rows, D], targets [rows], weights [rows]) -> (the float32 sum the step
# differentiates, a tree of float32 metric sums): one tile's share of a loss (cross-entropy; distillation's KL).
TileLoss = Callable[[Any, Any, jax.Array, jax.Array, jax.Array], tuple[jax.Array, Any]]


def valid_tilings(rows: int) -> list[int]:
  return [n for n in range(1, rows + 1) if rows % n == 0]


def _tiles(x: jax.Array, num_tiles: int) -> jax.Array:
  """[B, T, ...] -> [N, B·T / N, ...], tile i holding rows i, i + N, i + 2N, ...

  Strided rather than contiguous tiles: each tile then takes the same share of
  every batch shard, so the rows axis keeps its batch sharding and no tile
  lives on one device alone.
  """
  rows = x.shape[0] * x.shape[1]
  x = x.reshape(rows // num_tiles, num_tiles, *x.shape[2:])
  return jnp.moveaxis(x, 1, 0)


def _untile(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  return jnp.moveaxis(x, 0, 1).reshape(shape)


def _tile_loss(head: Head, z_loss_multiplier: float, trainable, frozen, hidden, targets, weights):
  """(weighted sum of per-token cross-entropy + z-loss, weighted sum of z-loss) of one tile, in float32."""
  logits = head(trainable, frozen, hidden)
  per_token, z_loss = losses.cross_entropy_with_z_loss(logits, targets, z_loss_multiplier=z_loss_multiplier)
  return jnp.sum(per_token * weights), jnp.sum(z_loss * weights)


def _tile_inputs(hidden, targets, weights, num_tiles):
  return _tiles(hidden, num_tiles), _tiles(targets, num_tiles), _tiles(weights, num_tiles)


def _zero_sums(tile_loss: TileLoss, trainable, frozen, tiles):
  # The carry stays float32 whatever the activation dtype.
  shapes = jax.eval_shape(tile_loss, trainable, frozen, *jax.tree.map(lambda x: x[0], tiles))
  return jax.tree.map(lambda s: jnp.zeros(s.shape, jnp.float32), shapes)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 6))
def _tiled_loss(tile_loss, trainable, frozen, hidden, targets, weights, num_tiles):
  """Undifferentiated (evaluation): the sums alone, one tile's logits at a time."""

  def body(total, tile):
    h, t, w = tile
    h = sharding.constrain(h, ("activation_batch", "activation_embed"))
    return jax.tree.map(jnp.add, total, tile_loss(trainable, frozen, h, t, w)), None

  tiles = _tile_inputs(hidden, targets, weights, num_tiles)
  return jax.lax.scan(body, _zero_sums(tile_loss, trainable, frozen, tiles), tiles)[0]


def _forward(tile_loss, trainable, frozen, hidden, targets, weights, num_tiles):
  """Differentiated (training): the sums and, in the same pass over each tile, their gradient.

  The loss is a scalar, so its gradient is a fixed field scaled by the
  incoming cotangent. Taking it while the tile's logits are at hand costs the
  three matmuls of an untiled step; deferring it to the backward pass would
  recompute every tile's logits, a fourth.
  """

  def body(carry, tile):
    total, grad_sum = carry
    h, t, w = tile
    h = sharding.constrain(h, ("activation_batch", "activation_embed"))
    token_sum, vjp, metric_sums = jax.vjp(lambda p, x: tile_loss(p, frozen, x, t, w), trainable, h, has_aux=True)
    grad_params, grad_hidden = vjp(jnp.ones((), jnp.float32))
    total = jax.tree.map(jnp.add, total, (token_sum, metric_sums))
    return (total, jax.tree.map(jnp.add, grad_sum, grad_params)), grad_hidden

  tiles = _tile_inputs(hidden, targets, weights, num_tiles)
  # Accumulate in float32 even for bfloat16 weights: N partial sums would round otherwise.
  zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.promote_types(p.dtype, jnp.float32)), trainable)
  (sums, grad_params), grad_hidden = jax.lax.scan(body, (_zero_sums(tile_loss, trainable, frozen, tiles), zeros), tiles)
  grad_hidden = _untile(grad_hidden, hidden.shape)
  return sums, (grad_params, grad_hidden, trainable, frozen, hidden, targets, weights)


def _backward(tile_loss, num_tiles, residuals, cotangents):
  grad_params, grad_hidden, trainable, frozen, hidden, targets, weights = residuals
  # The metric sums (the z-loss's) are metrics: `tiled_sums` stops their
  # gradient, so their cotangent is always zero; the token sum already includes the z-loss.
  scale, _ = cotangents
  # Explicit zeros, never None, for everything not differentiated: the frozen
  # state may hold scanned stacks whose layer axis is not 0, which a None
  # cotangent would be expanded against with the wrong layout.
  return (
      jax.tree.map(lambda g, p: (scale * g).astype(p.dtype), grad_params, trainable),
      jax.tree.map(_zero_cotangent, frozen),
      (scale * grad_hidden).astype(hidden.dtype),
      _zero_cotangent(targets),
      _zero_cotangent(weights),
  )


def _zero_cotangent(x):
  x = jnp.asarray(x) if not isinstance(x, jax.Array) else x
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros_like(x)
  return np.zeros(x.shape, jax.dtypes.float0)


_tiled_loss.defvjp(_forward, _backward)


def tiled_cross_entropy(
    head: Head,
    trainable: Any,
    frozen: Any,
    hidden: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    *,
    num_tiles: int,
    z_loss_multiplier: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
  """(sum of weighted per-token cross-entropy + z-loss, sum of weighted z-loss), in float32.

  hidden [B, T, D], targets and weights [B, T]. Gradients flow from the first
  sum to `trainable` (the head's parameters) and `hidden`; `frozen` is read
  but not differentiated, and the z-loss sum is a metric with no gradient.
  Equal to `losses.cross_entropy_with_z_loss` on `head`'s full logits, summed.
  """
  tile_loss = functools.partial(_tile_loss, head, z_loss_multiplier)
  return tiled_sums(tile_loss, trainable, frozen, hidden, targets, weights, num_tiles=num_tiles)


def tiled_sums(
    tile_loss: TileLoss, trainable: Any, frozen: Any, hidden: jax.Array, targets: jax.Array, weights, *, num_tiles: int
) -> tuple[jax.Array, Any]:
  """(sum of `tile_loss`'s first output over all tiles, the sum of its metric tree), in float32.

  `tiled_cross_entropy` with any per-tile loss: gradients flow from the first
  sum to `trainable` and `hidden` [B, T, D], taken tile by tile; the metrics
  have none.
  """
  rows = hidden.shape[0] * hidden.shape[1]
  if num_tiles < 1 or rows % num_tiles:
    valid = valid_tilings(rows)
    raise ConfigError(
        f"num_vocab_tiling={num_tiles} does not divide the {rows} rows (batch x length) of a step's "
        f"hidden states; valid values: {valid if len(valid) <= 16 else valid[:16] + ['...']}"
    )
  if targets.shape != hidden.shape[:2] or weights.shape != hidden.shape[:2]:
    raise ValueError(
        f"tiled_cross_entropy: targets {targets.shape} and weights {weights.shape} must be {hidden.shape[:2]}"
    )
  token_sum, metric_sums = _tiled_loss(
      tile_loss, trainable, frozen, hidden, targets, weights.astype(jnp.float32), num_tiles
  )
  return token_sum, jax.lax.stop_gradient(metric_sums)


def head_params(config: Config, params: Mapping[str, Any]) -> dict:
  """The canonical subtree the output head reads: the final norm and the projection (or the tied table)."""
  head = {"decoder": {"decoder_norm": params["decoder"]["decoder_norm"]}}
  if config.logits_via_embedding:
    head["token_embedder"] = {"embedding": params["token_embedder"]["embedding"]}
  else:
    head["decoder"]["logits_dense"] = params["decoder"]["logits_dense"]
  return head


def canonical_head(config: Config) -> Head:
  """`ops.output_head.output_logits` bound to canonical head parameters: the decoders' own head, as a function."""
  dtype = jnp.dtype(config.dtype)

  def head(trainable, frozen, hidden):
    del frozen  # the head reads nothing else
    x = hidden[:, None, :]  # [rows, 1, D]: the ops take [batch, length, D]
    decoder = trainable["decoder"]
    norm = output_head.final_norm(
        config.normalization, decoder["decoder_norm"], epsilon=config.normalization_layer_epsilon, dtype=dtype
    )
    options = dict(
        normalize_embedding_logits=config.normalize_embedding_logits, final_logits_soft_cap=config.final_logits_soft_cap
    )
    if config.logits_via_embedding:
      embedding = trainable["token_embedder"]["embedding"]
      logits = output_head.output_logits(x, norm=norm, embedding=embedding, dtype=dtype, **options)
    else:
      kernel = decoder["logits_dense"]["kernel"]
      project = functools.partial(linear.dense_general, kernel=kernel, in_ndim=1, dtype=dtype)
      logits = output_head.output_logits(x, norm=norm, project=project, **options)
    return logits[:, 0, :]

  return head


class TiledCrossEntropy(CrossEntropy):
  """`CrossEntropy`'s numbers, with the logits computed `num_vocab_tiling` row tiles at a time.

  The forward pass still builds its own logits, but nothing reads them, so
  XLA drops that computation: the step never holds [B, T, V]. The head's
  parameters enter the custom_vjp as a canonical subtree, and nothing else of
  the model does, so no other parameter needs a cotangent from it.
  """

  def __init__(self, config: Config):
    super().__init__(config.z_loss_multiplier)
    self.config = config
    self.head = canonical_head(config)

  @classmethod
  def enabled(cls, config: Config) -> bool:
    return config.num_vocab_tiling > 1

  @classmethod
  def from_config(cls, config: Config) -> "TiledCrossEntropy":
    return cls(config)

  def __call__(self, forward: Forward, batch, reference: Forward | None = None):
    _, intermediates = forward(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    token_sum, z_loss_sum = tiled_cross_entropy(
        self.head,
        head_params(self.config, forward.canonical(forward.params)),
        {},
        intermediates["decoder/hidden_states"],
        batch["targets"],
        mask,
        num_tiles=self.config.num_vocab_tiling,
        z_loss_multiplier=self.z_loss_multiplier,
    )
    return self.total(token_sum, z_loss_sum, mask, intermediates)
