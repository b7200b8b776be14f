"""The one place that picks a run's loss, trainer and after-update hooks from its config.

The model and the train state's backend come from `maxbridge.models.dispatch`
(the one reader of the three flags); this module adds what training needs.
"""

import functools

from jax.sharding import Mesh

from maxbridge.core.config import Config
from maxbridge.models import dispatch, lora
from maxbridge.models.model import LinenModel
from maxbridge.training import lora_trainer, qk_clip, vocab_tiling
from maxbridge.training.loss import CrossEntropy, Loss
from maxbridge.training.posttrain import dpo, grpo
from maxbridge.training.trainer import AfterUpdate, LinenTrainer, NNXTrainer, Trainer


def create_loss(config: Config) -> Loss:
  """The training objective for `config`: DPO, GRPO, tiled or plain cross-entropy (SFT is cross-entropy on SFT rows)."""
  if config.use_dpo:
    return dpo.DPO(config.dpo_beta, config.dpo_label_smoothing)
  if config.use_grpo:
    return grpo.GRPO(config.grpo_beta, config.grpo_epsilon)
  if config.num_vocab_tiling > 1:
    return vocab_tiling.TiledCrossEntropy(config)
  return CrossEntropy(z_loss_multiplier=config.z_loss_multiplier)


def create_trainer(
    config: Config,
    mesh: Mesh | None = None,
    *,
    loss: Loss | None = None,
    after_update: AfterUpdate | None = None,
) -> Trainer:
  """The train state backend for `pure_nnx`, around the model the other two flags pick.

  `mesh` defaults to one built from the config over all devices, `loss` to
  `create_loss(config)`. `after_update` maps the canonical parameters after
  every optimizer update, the same on both backends (QK-Clip when
  `use_qk_clip`, else none).
  """
  if config.checkpoint_is_quantized:
    raise ValueError(
        "checkpoint_is_quantized=true: the weights are frozen int8 values and scales for serving, which cannot "
        "be trained; train the float checkpoint instead (quantization=int8 trains it quantization-aware)"
    )
  if after_update is None and config.use_qk_clip:
    after_update = functools.partial(qk_clip.after_update, config=config)
  hooks = dict(loss=create_loss(config) if loss is None else loss, after_update=after_update)
  adapted = lora.is_enabled(config)  # LoRA: the adapters train, the base stays frozen
  if dispatch.nnx_train_state(config):
    trainer_class = lora_trainer.NNXLoraTrainer if adapted else NNXTrainer
    return trainer_class(config, functools.partial(dispatch.nnx_transformer, config), mesh, **hooks)
  model = LinenModel(config, dispatch.linen_transformer(config), dispatch.sample_inputs(config))
  return (lora_trainer.LinenLoraTrainer if adapted else LinenTrainer)(config, model, mesh, **hooks)
