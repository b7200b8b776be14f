"""The one place that picks a run's loss, trainer (backend and what trains) and hooks from its config.

The model and the train state's backend come from `maxbridge.models.dispatch`
(the one reader of the three flags); this module adds what training needs. A
loss is one entry of `LOSSES`; the keys a resume may not change are each
feature's own, collected here (`FIXED_KEYS`, `resume_keys`).
"""

import functools

import jax
from jax.sharding import Mesh

from maxbridge.core import array_limits, config_keys
from maxbridge.core.config import Config, ConfigError
from maxbridge.models import dispatch, lora
from maxbridge.models.model import LinenModel
from maxbridge.training import diloco, distill, hooks, qk_clip, vocab_tiling
from maxbridge.training.backends import LinenTrainer, NNXTrainer
from maxbridge.training.loss import CrossEntropy, Loss, StartingPolicy
from maxbridge.training.posttrain import dpo, grpo, kto, preference
from maxbridge.training.trainable import AllParams, LoraAdapters
from maxbridge.training.trainer import AfterUpdate, Trainer

# The losses a run trains with, asked in turn: the first whose `enabled(config)` holds is the run's (`create_loss`).
LOSSES: tuple[type[Loss], ...] = (
    dpo.DPO,
    preference.ORPO,
    preference.SimPO,
    kto.KTO,
    grpo.GRPO,
    distill.Distillation,
    vocab_tiling.TiledCrossEntropy,
    CrossEntropy,
)

# Keys fixed when a run starts, each feature's own, in the order a refused resume names them: what the model computes
# and which optimizer it trains with, how the trees are laid out (scan_layers), LoRA's adapters and their scale, quantization, what
# the run optimises (each loss's: its curve would change meaning mid-run), DiLoCo's replicas, and what it learns
# from (its batch sources'). Resuming with another value would read the same bytes as another model, fail with a
# list of paths that does not say why, or go on from a step on other data. The other keys (learning rate, steps, logging, the
# backend flags) may change on resume, as in MaxText.
FIXED_KEYS = (
    *config_keys.MODEL_KEYS,  # what the model computes, which every reader takes from config.yml
    "opt_type",  # what the optimizer state holds
    "scan_layers",
    "param_scan_axis",
    *LoraAdapters.fixed_keys,
    "quantization",
    "use_qwix_quantization",
    *(key for loss in LOSSES for key in loss.fixed_keys),
    *diloco.DiLoCoTrainer.fixed_keys,
    *hooks.Data.fixed_keys,
    *hooks.Sampled.fixed_keys,
)
# Keys only a run's batch sources read, never its train step: configs that differ only in these (and in the loop's
# own, `loop.step_key`) can share a trainer.
SOURCE_KEYS = frozenset({*hooks.Data.source_keys, *hooks.Sampled.source_keys})


def resume_keys(config: Config, trainer: Trainer | diloco.DiLoCoTrainer) -> tuple[str, ...]:
  """The keys a resume of `config`'s run by `trainer` may not change: `FIXED_KEYS`, and those of the frozen model
  its loss reads (`Frozen.fixed_keys`); with restart_data_on_resume, not the dataset's (the new data from its
  start)."""
  frozen = trainer.loss.frozen
  keys = tuple(dict.fromkeys(FIXED_KEYS + (() if frozen is None else frozen.fixed_keys)))
  if config.restart_data_on_resume:
    keys = tuple(key for key in keys if key not in hooks.Data.fixed_keys)
  return keys


def create_loss(config: Config) -> Loss:
  """The training objective for `config`: the first of `LOSSES` it enables (DPO, GRPO, distillation from a
  teacher, tiled or plain cross-entropy; SFT is cross-entropy on SFT rows)."""
  ignored = distill.ignored_keys(config)
  if ignored:
    raise ConfigError(
        f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} read only by distillation from a teacher, and "
        "this run has none, so it would train on "
        "plain cross-entropy: set teacher_overrides (the teacher's config, e.g. '{model_name: llama-small, "
        "load_parameters_path: /ckpt}') or distill_logits_path (a teacher's logits from `maxbridge distill-logits`), "
        "or leave those keys at their defaults"
    )
  return next(loss for loss in LOSSES if loss.enabled(config)).from_config(config)


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
  if config.use_multimodal:
    # Training with images (batches of images, freeze_vision_encoder_params) is not built: a text-only step would
    # leave the tower untrained, or decay it by weight decay, whatever freeze_vision_encoder_params says.
    raise ConfigError(
        "use_multimodal=true: training with images is not built yet (freeze_vision_encoder_params has nothing to "
        "act on); train the language model alone with use_multimodal=false (import-hf reads a multimodal folder's "
        "language model so), and run the model with images through generate --image or mb.Engine"
    )
  # XLA sees the step's global shapes, the rows of every device at once (a Config checked one device's): refused
  # before the model is built.
  devices = jax.device_count() if mesh is None else mesh.size
  array_limits.check_length(config, config.per_device_batch_size * devices, ConfigError, f" ({devices} devices)")
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

  GRPO samples its batches from the policy; a loss that reads the frozen
  starting policy (DPO's, GRPO's) holds it and checks it on resume, as
  distillation its teacher; LoRA checks the base it resumes on; QK-Clip logs
  the largest attention logit; the run keeps (and on resume checks) its tokenizer.
  """
  source = hooks.Sampled(config, trainer) if config.use_grpo else hooks.Data(config)
  run_hooks: list[hooks.Hook] = []
  if isinstance(trainer.loss.frozen, StartingPolicy):
    run_hooks.append(hooks.FrozenReference())
  if isinstance(trainer.loss.frozen, distill.Teacher):
    run_hooks.append(hooks.TeacherReference())
  if lora.is_enabled(config):
    run_hooks.append(hooks.LoraBase())
  if config.use_qk_clip:
    run_hooks.append(hooks.MaxLogits())
  if not config.use_grpo and config.dataset_path and (config.dataset_type in ("text", "sft") or config.preference_loss):
    run_hooks.append(hooks.DataFiles())  # the in-memory dataset's files, checked on resume
  run_hooks.append(hooks.RunTokenizer())  # the run keeps its tokenizer_path's files, checked on resume
  return source, run_hooks
