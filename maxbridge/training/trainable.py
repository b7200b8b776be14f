"""What a run trains: the policy a trainer is parameterised by (`maxbridge.training.trainer`).

A policy decides, on canonical trees and the same for both backends:
- the split: the tree the optimizer trains (`abstract_trained`), and the
  frozen tree the state holds beside it (`abstract_stored`: None when the
  model's own parameters are what trains);
- the view: the canonical parameters the forward pass runs on (`view`), and
  those a caller reads as the model's (`params`);
- the initial state's parts (`initial`), and so the checkpoint's: checkpoints
  hold the trained tree under `collection`, its optimizer state and the step.

`AllParams` trains every parameter. `LoraAdapters` trains low-rank adapters on
a frozen base, stored quantized under QLoRA (the math: `maxbridge.models.lora`).
Freezing all but some parameters, or holding a frozen teacher, is one more
policy, not one more trainer.
"""

import abc
import functools
from typing import Any

import jax
import jax.numpy as jnp

from maxbridge.core.config import Config
from maxbridge.models import lora

Params = dict[str, Any]


class Trainable(abc.ABC):
  """The split of a model into what trains and what stays frozen; see the module docstring."""

  collection = "params"  # the trained tree's name in the Linen state and in checkpoints
  # True: the optimizer updates the model's own parameters (the NNX model holds them). False: a tree of its own,
  # kept beside the model, which holds the frozen `stored` tree instead.
  trains_model = True
  # Checkpoints hold the model's parameters; else the trained tree only, the base coming from where the run started.
  saves_params = True
  # A frozen reference model (DPO's) is a copy of the parameters; else the policy derives it from the state.
  copies_reference = True
  abstract_stored: Params | None = None
  stored_axes: Params | None = None
  # Why an NNX model cannot hold `stored` (QLoRA: quantized kernels are not its parameters); None when it can.
  stored_outside_model: str | None = None
  # Config keys fixed on resume in every run (`recipe.FIXED_KEYS`): another value would read its checkpoints as
  # another model's.
  fixed_keys: tuple[str, ...] = ()

  def __init__(self, config: Config, abstract_params: Params, kernel_axes: Params):
    self.config = config
    self.abstract_trained: Params = abstract_params
    self.trained_axes: Params = kernel_axes

  @abc.abstractmethod
  def initial(self, params: Params, seed) -> tuple[Params, Params | None]:
    """(trained, stored) of a new run whose model starts from the canonical `params` (traceable)."""

  @abc.abstractmethod
  def view(self, trained: Params, stored: Params | None, step: jax.Array | None = None) -> Params:
    """The canonical parameters the forward pass runs on (traceable, differentiable in `trained`); `step` is a
    train step's (randomness such as LoRA's dropout applies), None otherwise."""

  @abc.abstractmethod
  def params(self, trained: Params, stored: Params | None) -> Params:
    """The model's canonical parameters as a caller reads and replaces them (LoRA: the base)."""

  @abc.abstractmethod
  def with_params(self, params: Params) -> dict:
    """The parts of the state tree that hold `params` (see `params`): {"params": {collection: ...}} or {"stored": ...}."""

  @abc.abstractmethod
  def reference(self, trained: Params, reference: Params) -> Params:
    """The trained tree of the reference pass, given the frozen reference's canonical parameters."""


class AllParams(Trainable):
  """Every parameter trains: the trained tree is the canonical one, and nothing else is held."""

  def initial(self, params, seed):
    return params, None

  def view(self, trained, stored, step=None):
    return trained

  def params(self, trained, stored):
    return trained

  def with_params(self, params):
    return {"params": {self.collection: params}}

  def reference(self, trained, reference):
    return reference


class LoraAdapters(Trainable):
  """LoRA: adapters train; the base stays frozen (QLoRA: stored quantized, dequantized in each forward pass)."""

  collection = lora.COLLECTION
  trains_model = False
  saves_params = False
  copies_reference = False  # the reference is the base: the adapters off
  fixed_keys = ("lora_rank", "lora_alpha", "lora_module_path", "lora_weight_qtype")

  def __init__(self, config: Config, abstract_params: Params, kernel_axes: Params):
    adapters = lora.abstract_adapters(config, abstract_params, kernel_axes)
    super().__init__(config, adapters, lora.adapter_axes(config, abstract_params, kernel_axes))
    # The base as the state holds it (QLoRA: quantized kernels; otherwise the canonical tree itself).
    self.kernel_axes = kernel_axes  # which say each kernel's inputs (`lora.in_ndim`)
    self.abstract_stored = jax.eval_shape(
        functools.partial(lora.quantize_base, config, kernel_axes=kernel_axes), abstract_params
    )
    self.stored_axes = lora.stored_axes(config, abstract_params, kernel_axes)
    if config.lora_weight_qtype:
      self.stored_outside_model = (
          f"lora_weight_qtype={config.lora_weight_qtype!r}: QLoRA stores the base outside the model"
      )

  def initial(self, params, seed):
    adapters = lora.init_adapters(self.abstract_trained, seed, self.config)
    return adapters, lora.quantize_base(self.config, params, self.kernel_axes)

  def view(self, trained, stored, step=None):
    # Also what losses that read the model directly (vocabulary tiling's head) see: the adapted weights.
    if step is not None and self.config.lora_dropout:
      trained = lora.drop_adapter_inputs(self.config, trained, lora.dropout_key(self.config, step))
    return lora.merge(self.config, lora.dequantize_base(self.config, stored), trained)

  def params(self, trained, stored):
    return lora.dequantize_base(self.config, stored)  # QLoRA: the base's dequantized values

  def with_params(self, params):
    return {"stored": lora.quantize_base(self.config, params, self.kernel_axes)}

  def reference(self, trained, reference):
    # So the reference needs no copy of the base (a float one, under QLoRA): zeros give a zero update.
    del reference
    return jax.tree.map(jnp.zeros_like, trained)
