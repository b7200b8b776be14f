"""Training objectives as objects the one train step calls; `maxbridge.training.recipe.create_loss` picks one.

A loss reads the batch keys it declares, runs the forward pass it is given
(as often as it needs: DPO runs it on chosen and rejected rows), and returns
`(sum, aux)`: a sum over the batch, never a mean, with `aux["tokens"]` the
count to divide by. Gradient accumulation adds micro-batch sums and divides
once, so it equals the full-batch step exactly. Every other `aux` entry is
reported per token too (`z_loss`, `moe_lb_loss`, ...).

A loss declares what it needs of the step, and the trainer provides it the
same way for every loss: its batch keys, its metrics, and a frozen model it
reads but never trains (`frozen`: the trained model as the step or the run
began, or a model of its own), whose pass it is called with as `reference`.
It declares too when a run trains with it (`enabled`, `from_config`: the
recipe asks each loss of `recipe.LOSSES` in turn) and the config keys a resume
may not change (`fixed_keys`: its curve would change meaning mid-run).
"""

import abc
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from maxbridge.core.config import Config
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

  def at(self, params: Any) -> "Forward":
    """The same pass over other parameters."""
    return Forward(self.apply, params, self.frozen, self._canonical)


class Frozen(abc.ABC):
  """A model a loss reads and never trains (`Loss.frozen`), which the trainer provides the same way whatever it is.

  Its parameters, placed by `shardings`, enter the compiled step as an argument, never as constants of it; the
  trainer holds them (`Trainer.hold_frozen`). Its pass (`forward`) is the `reference` the loss is called with,
  and no gradient flows through it. `trainer` is the `Trainer` asking.
  """

  # Keys a run that reads it may not change on resume, beyond its loss's own (`Loss.fixed_keys`).
  fixed_keys: tuple[str, ...] = ()

  def shardings(self, trainer) -> Any:
    """Where the step takes its parameters (a tree of shardings); None when it takes none."""
    return None

  def abstract(self, trainer) -> Any:
    """Its parameters' shapes, each with its sharding: what ahead-of-time lowering takes (nothing read or placed)."""
    return None

  def params(self, trainer, start, held) -> Any:
    """Its parameters, placed by `shardings`: `start` is the state training starts from (None: not given), `held`
    the parameters the trainer holds already (None: none yet)."""
    return None

  @abc.abstractmethod
  def forward(self, trainer, policy: Forward, params) -> Forward:
    """Its pass over `params` (its parameters as the step takes them); `policy` is the trained model's pass over
    the parameters the step started from."""


class StepPolicy(Frozen):
  """The trained model as the step began: the parameters the step differentiates, with no gradient through its pass
  (a policy-gradient loss's old policy, with one update per batch). No copy is held."""

  def forward(self, trainer, policy: Forward, params) -> Forward:
    return policy


class StartingPolicy(Frozen):
  """The trained model as the run began, frozen: a copy of its parameters taken from the state training starts
  from, also on resume, so that checkpoints hold the trained model only. A policy that derives it from the state
  needs no copy (`Trainable.copies_reference`: LoRA's base is the model with the adapters off)."""

  # Where the run started from is its frozen model: the values there are checked by fingerprint
  # (`hooks.FrozenReference`).
  fixed_keys = ("load_parameters_path",)

  def shardings(self, trainer) -> Any:
    return trainer.params(trainer.state_shardings) if trainer.trainable.copies_reference else None

  def abstract(self, trainer) -> Any:
    if not trainer.trainable.copies_reference:
      return {}
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), trainer.abstract_params, self.shardings(trainer)
    )

  def params(self, trainer, start, held) -> Any:
    if not trainer.trainable.copies_reference:
      return {}
    if start is not None:
      return trainer.copy_params(start)
    if held is None:
      raise ValueError(
          f"{type(trainer.loss).__name__} needs a reference model (the frozen starting policy): call "
          "trainer.hold_frozen(state) with the state training starts from (maxbridge.train does)"
      )
    return held

  def forward(self, trainer, policy: Forward, params) -> Forward:
    return policy.at(trainer.trainable.reference(policy.params, params))


class Loss(abc.ABC):
  """What a train step minimises; subclasses set `batch_keys` and implement `__call__`."""

  # Each an int32 [batch, length] array (data.py's convention), but those in `float_keys`, float32 (a policy
  # gradient's advantages): so that the data pipeline and the ahead-of-time compile know the batch from the loss.
  batch_keys: tuple[str, ...] = ()
  float_keys: tuple[str, ...] = ()
  # aux entries the loop writes to metrics.jsonl (each per `tokens`, as the loss).
  metric_keys: tuple[str, ...] = ()
  # The model it reads and never trains, if any (`Frozen`): the step passes its pass as `reference`.
  frozen: Frozen | None = None
  # Config keys fixed on resume: what it optimises, whose curve would change meaning mid-run. Fixed in every run,
  # whatever its loss (a run may not switch to or from this one either); `recipe.LOSSES` collects them.
  fixed_keys: tuple[str, ...] = ()

  def abstract_batch(self, rows: int, length: int) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes and dtypes of a batch of `rows` rows of `length` tokens, as its data arrives."""
    return {
        key: jax.ShapeDtypeStruct((rows, length), jnp.float32 if key in self.float_keys else jnp.int32)
        for key in self.batch_keys
    }

  @classmethod
  def enabled(cls, config: Config) -> bool:
    """Whether `config` trains with this loss: `recipe.create_loss` asks each of `recipe.LOSSES` in turn."""
    return False

  @classmethod
  def from_config(cls, config: Config) -> "Loss":
    """The loss a run of `config` trains with."""
    raise NotImplementedError(f"{cls.__name__} is not built from a config: pass it to recipe.create_trainer(loss=)")

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

  @classmethod
  def enabled(cls, config: Config) -> bool:
    return True  # the default: asked last

  @classmethod
  def from_config(cls, config: Config) -> "CrossEntropy":
    return cls(
        z_loss_multiplier=config.z_loss_multiplier,
        mtp_loss_scaling_factor=config.mtp_loss_scaling_factor if config.mtp_num_layers else None,
        mtp_eval_target_module=config.mtp_eval_target_module,
    )

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
