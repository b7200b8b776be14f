"""The one place that picks a run's loss, trainer (backend and what trains) and hooks from its config.

The model and the train state's backend come from `maxbridge.models.dispatch`
(the one reader of the three flags); this module adds what training needs.
"""

import functools

from jax.sharding import Mesh

from maxbridge.core.config import Config, ConfigError
from maxbridge.models import dispatch, lora
from maxbridge.models.model import LinenModel
from maxbridge.training import diloco, distill, hooks, qk_clip, vocab_tiling
from maxbridge.training.backends import LinenTrainer, NNXTrainer
from maxbridge.training.loss import CrossEntropy, Loss
from maxbridge.training.posttrain import dpo, grpo
from maxbridge.training.trainable import AllParams, LoraAdapters
from maxbridge.training.trainer import AfterUpdate, Trainer


def create_loss(config: Config) -> Loss:
  """The training objective for `config`: DPO, GRPO, distillation from a teacher, tiled or plain cross-entropy (SFT
  is cross-entropy on SFT rows)."""
  if config.distill_beta and not distill.is_enabled(config):
    # Checked here, not in config_rules: a teacher's own config carries its student's distill_beta (so that its
    # layers return what the feature loss compares), and it has no teacher.
    raise ConfigError(
        f"distill_beta={config.distill_beta} adds a feature loss against a teacher, and this run has none: set "
        "teacher_overrides (the teacher's config), or distill_beta=0"
    )
  if config.use_dpo:
    return dpo.DPO(config.dpo_beta, config.dpo_label_smoothing)
  if config.use_grpo:
    return grpo.GRPO(config.grpo_beta, config.grpo_epsilon)
  if distill.is_enabled(config):
    teacher = None if config.distill_logits_path else distill.Teacher.for_student(config)
    return distill.Distillation(config, teacher)
  if config.num_vocab_tiling > 1:
    return vocab_tiling.TiledCrossEntropy(config)
  return CrossEntropy(
      z_loss_multiplier=config.z_loss_multiplier,
      mtp_loss_scaling_factor=config.mtp_loss_scaling_factor if config.mtp_num_layers else None,
      mtp_eval_target_module=config.mtp_eval_target_module,
  )


def create_trainer(
    config: Config,
    mesh: Mesh | None = None,
    *,
    loss: Loss | None = None,
    after_update: AfterUpdate | None = None,
) -> Trainer | diloco.DiLoCoTrainer:
  """The train state backend for `pure_nnx`, around the model the other two flags pick.

  `mesh` defaults to one built from the config over all devices, `loss` to
  `create_loss(config)`. `after_update` maps the canonical parameters after
  every optimizer update, the same on both backends (QK-Clip when
  `use_qk_clip`, else none). What trains: every parameter, or with
  `lora_rank` > 0 LoRA's adapters on the frozen base. With `enable_diloco`,
  that trainer runs on each DiLoCo replica (`diloco.DiLoCoTrainer`).
  """
  if config.checkpoint_is_quantized:
    raise ValueError(
        "checkpoint_is_quantized=true: the weights are frozen int8 values and scales for serving, which cannot "
        "be trained; train the float checkpoint instead (quantization=int8 trains it quantization-aware)"
    )
  if after_update is None and config.use_qk_clip:
    after_update = functools.partial(qk_clip.after_update, config=config)
  trainable = LoraAdapters if lora.is_enabled(config) else AllParams
  options = dict(loss=create_loss(config) if loss is None else loss, trainable=trainable, after_update=after_update)
  if dispatch.nnx_train_state(config):
    trainer = NNXTrainer(config, functools.partial(dispatch.nnx_transformer, config), mesh, **options)
  else:
    model = LinenModel(config, dispatch.linen_transformer(config), dispatch.sample_inputs(config))
    trainer = LinenTrainer(config, model, mesh, **options)
  return diloco.DiLoCoTrainer(trainer) if config.enable_diloco else trainer


def create_hooks(config: Config, trainer: Trainer) -> tuple[hooks.Data | hooks.Sampled, list[hooks.Hook]]:
  """(the batch source, the feature hooks) of a run of `config` by `trainer` (whose loss may be a caller's own).

  GRPO samples its batches from the policy; DPO's and GRPO's losses read the
  frozen starting policy; distillation checks the teacher it resumes with; LoRA
  checks the base it resumes on; QK-Clip logs the largest attention logit.
  """
  source = hooks.Sampled(config, trainer) if config.use_grpo else hooks.Data(config)
  run_hooks: list[hooks.Hook] = []
  if trainer.loss.frozen_reference:
    run_hooks.append(hooks.FrozenReference())
  if trainer.loss.teacher is not None:
    run_hooks.append(hooks.TeacherReference())
  if lora.is_enabled(config):
    run_hooks.append(hooks.LoraBase())
  if config.use_qk_clip:
    run_hooks.append(hooks.MaxLogits())
  return source, run_hooks
