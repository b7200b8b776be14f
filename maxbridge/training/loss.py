"""Training objectives as objects the one train step calls; `maxbridge.training.recipe.create_loss` picks one.

A loss reads the batch keys it declares, runs the forward pass it is given
(as often as it needs: DPO runs it on chosen and rejected rows), and returns
`(sum, aux)`: a sum over the batch, never a mean, with `aux["tokens"]` the
count to divide by. Gradient accumulation adds micro-batch sums and divides
once, so it equals the full-batch step exactly. Every other `aux` entry is
reported per token too (`z_loss`, `moe_lb_loss`, ...).
"""

import abc
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from maxbridge.ops import losses, mtp

Batch = Mapping[str, jax.Array]


class Forward:
  """The forward pass of the model in training, over `params` (differentiated) and `frozen` (only read).

  `forward(tokens, positions, segment_ids)`, each int32 [B, T], returns
  (logits [B, T, V], flat intermediates). A loss that must take the
  parameters as explicit arguments (a `custom_vjp`, as vocabulary tiling)
  reads `params` and `frozen` and calls `apply(params, frozen, ...)` itself;
  `canonical(params)` is the same parameters as a canonical tree (traceable,
  differentiable), for losses that read a part of the model directly.
  """

  def __init__(self, apply: Callable, params: Any, frozen: Any, canonical: Callable[[Any], dict] | None = None):
    self.apply = apply
    self.params = params
    self.frozen = frozen
    self._canonical = canonical

  def canonical(self, params: Any) -> dict:
    if self._canonical is None:
      raise NotImplementedError("this Forward was built without a canonical view of its parameters")
    return self._canonical(params)

  def __call__(self, tokens: jax.Array, positions: jax.Array, segment_ids: jax.Array):
    return self.apply(self.params, self.frozen, tokens, positions, segment_ids)


class Loss(abc.ABC):
  """What a train step minimises; subclasses set `batch_keys` and implement `__call__`."""

  # Each an int32 [batch, length] array (data.py's convention), so that the
  # data pipeline and the ahead-of-time compile know the batch from the loss.
  batch_keys: tuple[str, ...] = ()
  # True: the step also passes `reference`, the forward pass over parameters
  # that no gradient flows through (DPO's reference model, GRPO's old policy).
  needs_reference: bool = False
  # True: that reference is instead the policy the run started from, frozen
  # (DPO): `Trainer.set_reference` holds it, and a step without one fails.
  frozen_reference: bool = False
  # aux entries train.py writes to metrics.jsonl (each per `tokens`, as the loss).
  metric_keys: tuple[str, ...] = ()
  # A frozen model of its own (distillation's teacher, `maxbridge.training.distill.Teacher`): its `params` enter the
  # step as an argument (placed by its `logical_axes`), and the `reference` the step passes is its forward (`apply`).
  teacher: Any = None

  @abc.abstractmethod
  def __call__(self, forward: Forward, batch: Batch, reference: Forward | None = None) -> tuple[jax.Array, dict]:
    """(sum of the loss over the batch, aux with at least "tokens")."""


class CrossEntropy(Loss):
  """Next-token cross-entropy over non-padding targets, plus z-loss, the sown MoE load-balancing loss and, with
  `mtp_num_layers` > 0, the multi-token prediction loss."""

  batch_keys = ("inputs", "targets", "inputs_position", "inputs_segmentation", "targets_segmentation")

  def __init__(
      self,
      z_loss_multiplier: float = 0.0,
      *,
      mtp_loss_scaling_factor: float | None = None,
      mtp_eval_target_module: int = 0,
  ):
    self.z_loss_multiplier = z_loss_multiplier
    # None: the model has no MTP modules. Else the weight of their loss (MaxText's mtp_loss_scaling_factor).
    self.mtp_loss_scaling_factor = mtp_loss_scaling_factor
    self.mtp_eval_target_module = mtp_eval_target_module
    if mtp_loss_scaling_factor is not None:
      self.metric_keys = ("mtp_loss",) + (("mtp_acceptance_rate",) if mtp_eval_target_module else ())

  def __call__(self, forward: Forward, batch: Batch, reference: Forward | None = None) -> tuple[jax.Array, dict]:
    logits, intermediates = forward(batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    return self.terms(logits, batch, intermediates)

  def terms(self, logits: jax.Array, batch: Batch, intermediates: Mapping[str, Any]) -> tuple[jax.Array, dict]:
    """(sum of per-token losses, {"tokens", "z_loss", "moe_lb_loss"} and the MTP entries) over the non-padding
    targets."""
    mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    per_token, z_loss = losses.cross_entropy_with_z_loss(
        logits, batch["targets"], z_loss_multiplier=self.z_loss_multiplier
    )
    total, aux = self.total(jnp.sum(per_token * mask), jnp.sum(z_loss * mask), mask, intermediates)
    if "decoder/mtp_logits" not in intermediates:
      if self.mtp_loss_scaling_factor is not None:
        raise ValueError("this loss weighs multi-token prediction, but the model sowed no decoder/mtp_logits")
      return total, aux
    if self.mtp_loss_scaling_factor is None:
      raise ValueError("the model sows decoder/mtp_logits: build CrossEntropy with mtp_loss_scaling_factor")
    mtp_aux = self.mtp_terms(intermediates["decoder/mtp_logits"], batch, aux["tokens"])
    return total + mtp_aux["mtp_loss"], {**aux, **mtp_aux}

  def mtp_terms(self, mtp_logits: jax.Array, batch: Batch, tokens: jax.Array) -> dict:
    """{"mtp_loss"[, "mtp_acceptance_rate"]} of the MTP logits [K, B, T, V], each times `tokens` (aux's convention).

    As MaxText: the cross-entropy summed over modules and their targets, over the count of those targets, times
    mtp_loss_scaling_factor. A per-batch mean, so it enters weighted by this batch's token count (as the MoE loss).
    """
    sums, counts, aux = jnp.float32(0.0), jnp.float32(0.0), {}
    for k in range(1, mtp_logits.shape[0] + 1):
      targets, weights = mtp.module_targets(
          batch["targets"], batch["targets_segmentation"], batch["inputs_segmentation"], k
      )
      per_token, _ = losses.cross_entropy_with_z_loss(mtp_logits[k - 1], targets)
      sums, counts = sums + jnp.sum(per_token * weights), counts + jnp.sum(weights)
      if k == self.mtp_eval_target_module:  # how often module k's top-1 is the target: a drafter's acceptance
        hits = (jnp.argmax(mtp_logits[k - 1], axis=-1) == targets) * weights
        aux["mtp_acceptance_rate"] = jnp.sum(hits) / jnp.maximum(jnp.sum(weights), 1.0) * tokens
    aux["mtp_loss"] = self.mtp_loss_scaling_factor * sums / jnp.maximum(counts, 1.0) * tokens
    return aux

  @staticmethod
  def total(token_sum: jax.Array, z_loss_sum: jax.Array, mask: jax.Array, intermediates: Mapping[str, Any]):
    """Adds the MoE load-balancing loss to a token sum (which includes the z-loss); returns (sum, aux).

    The load-balancing loss (sown by MoE decoders, already weighted) is a
    per-batch mean, so it enters weighted by this batch's token count.
    """
    tokens = jnp.sum(mask)
    moe_lb_loss = intermediates.get("decoder/moe_lb_loss", jnp.float32(0.0)) * tokens
    aux = {"tokens": tokens, "z_loss": z_loss_sum, "moe_lb_loss": moe_lb_loss}
    if "decoder/max_logits" in intermediates:  # [layers, heads], sown when QK-Clip is on
      aux["maxima"] = {"max_logits": intermediates["decoder/max_logits"]}
    return token_sum + moe_lb_loss, aux
