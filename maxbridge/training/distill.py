"""Knowledge distillation: the student learns from a frozen teacher's softened distribution and from the labels.

Per token, with the teacher's distribution p and the student's q, both at temperature T:

    loss = alpha * T^2 * KL(p_T || q_T) + (1 - alpha) * cross-entropy(q, label)

(Hinton et al.: T^2 keeps the soft term's gradients the size of the hard
term's as T grows). On when `teacher_overrides` is set: the teacher's own
config as a YAML mapping over the student's (its `model_name`, its
`load_parameters_path`, its backend flags...). "{}" is the student's own model
and starting weights. The teacher is read through
`maxbridge.interop.pretrained` (ours, MaxText's, a Hugging Face folder; scanned
or not), may be another size, family or backend, and must share the
vocabulary.

The teacher runs inside the same compiled step: its parameters are an
argument of the step (the trainer places them once on the run's mesh), its
forward pass the step's reference pass, under `stop_gradient`. With
`num_vocab_tiling` > 1 the KL is tiled with the cross-entropy
(`vocab_tiling.tiled_sums`): each tile computes both models' logits from their
hidden states and heads, so neither model's [B, T, V] logits are ever held.

With `distill_beta` > 0 the loss adds beta times MaxText's feature loss
(`distill_beta`, `distill_feature_loss_type`, `distill_layer_indices`): each
attention layer's output after its out projection [B, T, emb_dim]
(`ops.attention.OUT_PROJECTION`, MaxText's `out_projection_activations`),
stacked over the decoder's layers [L, B, T, D] by both models, the layers at
`distill_layer_indices` taken from both (the same indices; null: all, which
needs as many layers in each), then per layer and token the cosine distance
(`optax.cosine_distance`, epsilon 1e-6, as MaxText's) or the squared error
averaged over the width, averaged over the chosen layers and the loss's
tokens. The teacher takes the student's distill_beta, so its layers return
the same activations. MaxText compares them element by element, with no
projection between widths; neither does this, so a teacher of another
`emb_dim` is refused.

Or offline: `write_logits` (`maxbridge distill-logits`) stores the teacher's
top-k logits of the run's training batches, and a run with
`distill_logits_path` reads them with its batches and runs no teacher; its KL
is `kl_top_k`, on the teacher's top k renormalised.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml

from maxbridge.core import canonical, files, sharding
from maxbridge.core.config import Config, ConfigError, base_values, load_config
from maxbridge.interop import pretrained
from maxbridge.interop.hf.families import HFError
from maxbridge.models import dispatch
from maxbridge.ops import attention, losses
from maxbridge.training import data, vocab_tiling
from maxbridge.training.loss import CrossEntropy, Forward, Frozen, Loss

# Keys a teacher of another model takes from the student unless its overrides say otherwise: the step's shapes,
# dtype and backend.
INHERITED = ("max_target_length", "dtype", "num_vocab_tiling", "pure_nnx", "enable_nnx", "pure_nnx_decoder")


def is_enabled(config: Config) -> bool:
  return bool(config.teacher_overrides.strip() or config.distill_logits_path)


# The keys only distillation's loss reads: without a teacher, a value other than base.yml's would be ignored.
# (distill_layer_indices is refused without distill_beta by `config_rules`; distill_beta needs a teacher in the step.)
TUNING_KEYS = ("distill_alpha", "distill_temperature", "distill_beta", "distill_feature_loss_type")


def ignored_keys(config: Config) -> list[str]:
  """The distillation keys `config` sets away from base.yml's values while it has no teacher (each `key=value`).

  Checked where a run builds its loss, not in `config_rules`: a teacher's own config carries its student's values
  (it takes distill_beta for its layers' outputs), and it has no teacher."""
  if is_enabled(config):
    return []
  defaults = base_values()
  return [f"{key}={getattr(config, key)!r}" for key in TUNING_KEYS if getattr(config, key) != defaults[key]]


def teacher_overrides(config: Config) -> dict[str, Any]:
  """`teacher_overrides` as a dict; a clear error if it is not a YAML mapping."""
  try:
    overrides = yaml.safe_load(config.teacher_overrides)
  except yaml.YAMLError as e:
    raise ConfigError(f"teacher_overrides={config.teacher_overrides!r} is not YAML: {e}") from e
  if not isinstance(overrides, dict):
    raise ConfigError(
        f"teacher_overrides={config.teacher_overrides!r} must be a mapping of the teacher's config keys, e.g. "
        "'{model_name: llama-small, load_parameters_path: /ckpt/5/items}' ('{}': the student's own model)"
    )
  return overrides


def load_teacher(config: Config) -> tuple[Config, dict | None, str]:
  """(the teacher's config, its canonical parameters or None for its seed's, where they come from) for `config`."""
  overrides = teacher_overrides(config)
  model_name = overrides.pop("model_name", None)
  path = overrides.pop("load_parameters_path", None if model_name else config.load_parameters_path)
  # The teacher distills nothing, but takes distill_beta: its layers then return the activations the feature
  # loss compares (MaxText's teacher shares the student's yml, and so its distill_beta, likewise).
  off = dict(teacher_overrides="", load_parameters_path="", distill_beta=config.distill_beta, distill_layer_indices=())
  if path:
    kwargs = {**{key: getattr(config, key) for key in INHERITED}, **overrides, **off}
    try:
      teacher_config, params = pretrained.load_pretrained(path, config=model_name, **kwargs)
    except HFError as e:
      raise ConfigError(f"teacher_overrides: the teacher at {path} cannot be read: {e} (give its model_name)") from e
  else:  # initial weights from the seed: the student's own (model_name unset) or another model's
    if model_name:
      teacher_config = load_config(model_name, **{**{key: getattr(config, key) for key in INHERITED}, **overrides, **off})
    else:
      teacher_config = config.replace(**{**overrides, **off})
    params = None
  if teacher_config.vocab_size != config.vocab_size:
    raise ConfigError(
        f"teacher_overrides: the teacher's vocabulary ({teacher_config.vocab_size} tokens, "
        f"{teacher_config.model_name}) is not the student's ({config.vocab_size} tokens, {config.model_name}); "
        "distillation compares their distributions token by token, so both must share one vocabulary"
    )
  return teacher_config, params, os.path.abspath(path) if path else f"seed {teacher_config.seed}"


class Teacher(Frozen):
  """A frozen model the loss reads: its config, parameter shapes and logical axes, and its forward pass.

  It holds no placed parameters of its own: `take_params` hands them over once
  (the trainer places them on its mesh, the one copy the run keeps), and its
  model is abstract, so `maxbridge compile` lowers the step on shapes alone.
  """

  def __init__(self, config: Config, params: dict | None = None, source: str | None = None):
    self.config = config
    self.model = dispatch.abstract_model(config)
    self.abstract_params = self.model.abstract_params()
    self.logical_axes = self.model.logical_axes()
    self.source = source or f"seed {config.seed}"  # as `hooks.TeacherReference` records it
    self._params = params
    self._taken = False

  @classmethod
  def for_student(cls, config: Config) -> Teacher:
    return cls(*load_teacher(config))

  def take_params(self) -> dict:
    """The canonical parameters in the model's layout (None given: its seed's), handed over once."""
    if self._taken:
      raise RuntimeError("the teacher's parameters were handed over already: the trainer holds them (frozen_params)")
    params, self._params, self._taken = self._params, None, True
    if params is None:
      return dispatch.create_model(self.config).params()
    return canonical.conform(params, self.abstract_params, self.config.param_scan_axis)

  def apply(self, params, frozen, tokens, positions, segment_ids):
    """(logits, flat intermediates): `Forward`'s apply."""
    del frozen
    return self.model.apply_with_intermediates(params, tokens, positions, segment_ids)

  # --- as the trainer provides it (`Frozen`) ---

  def shardings(self, trainer) -> Any:
    """Its parameters' shardings on the trainer's mesh, by its own logical axes."""
    return jax.tree.map(
        lambda axes: sharding.named_sharding(trainer.mesh, axes, trainer.rules),
        self.logical_axes,
        is_leaf=lambda x: isinstance(x, tuple),
    )

  def abstract(self, trainer) -> Any:
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), self.abstract_params, self.shardings(trainer)
    )

  def params(self, trainer, start, held) -> Any:
    """Placed once, on the trainer's mesh: the run's only copy."""
    del start
    return jax.device_put(self.take_params(), self.shardings(trainer)) if held is None else held

  def forward(self, trainer, policy: Forward, params) -> Forward:
    return Forward(self.apply, params, None)


def kl_top_k(values: jax.Array, indices: jax.Array, student_logits: jax.Array, temperature: float) -> jax.Array:
  """KL(p~_T || q_T) on the teacher's top k per position, [..., K] x [..., V] -> [...], in float32.

  p~_T is the teacher's softmax at T renormalised over its k largest logits
  (the mass of the rest is dropped); q_T is the student's softmax at T over
  the whole vocabulary, read at those k tokens. With k = V it is `kl_per_token`.
  """
  log_p = jax.nn.log_softmax(values.astype(jnp.float32) / temperature)
  log_q = jnp.take_along_axis(jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature), indices, axis=-1)
  return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def kl_per_token(teacher_logits: jax.Array, student_logits: jax.Array, temperature: float) -> jax.Array:
  """KL(p_T || q_T) per position, [..., V] -> [...], in float32."""
  log_p = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature)
  log_q = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature)
  return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


class Distillation(Loss):
  """alpha * T^2 * KL(teacher || student at T) + (1 - alpha) * cross-entropy, plus the z-loss and MoE's."""

  metric_keys = ("distill_kl", "distill_ce")
  # The teacher and the mix of KL, cross-entropy and feature loss; the teacher's values are checked by fingerprint
  # (`hooks.TeacherReference`).
  fixed_keys = (
      "teacher_overrides",
      "distill_alpha",
      "distill_temperature",
      "distill_beta",
      "distill_feature_loss_type",
      "distill_layer_indices",
  )

  def __init__(self, config: Config, teacher: Teacher | None):
    """`teacher` None: its top-k logits come with each batch (`distill_logits_path`, `OFFLINE_KEYS`)."""
    self.config = config
    self.teacher = teacher
    self.frozen = teacher
    self.alpha, self.temperature, self.beta = config.distill_alpha, config.distill_temperature, config.distill_beta
    self.batch_keys = CrossEntropy.batch_keys + (OFFLINE_KEYS if teacher is None else ())
    self.layers = config.distill_layer_indices
    if self.beta:
      self.metric_keys = Distillation.metric_keys + ("distill_feature",)
      if teacher is not None:
        _check_feature_teacher(config, teacher.config)

  @classmethod
  def enabled(cls, config: Config) -> bool:
    return is_enabled(config)

  @classmethod
  def from_config(cls, config: Config) -> Distillation:
    return cls(config, None if config.distill_logits_path else Teacher.for_student(config))

  def _per_token(self, student_logits, teacher_logits, targets):
    """(the loss, cross-entropy + z-loss, z-loss, KL) per position; `teacher_logits` [..., V] or offline
    (top-k values, their indices)."""
    ce, z_loss = losses.cross_entropy_with_z_loss(
        student_logits, targets, z_loss_multiplier=self.config.z_loss_multiplier
    )
    if isinstance(teacher_logits, tuple):
      kl = kl_top_k(*teacher_logits, student_logits, self.temperature)
    else:
      kl = kl_per_token(teacher_logits, student_logits, self.temperature)
    return (1.0 - self.alpha) * ce + self.alpha * self.temperature**2 * kl, ce, z_loss, kl

  def _tile_loss(self, width: int, trainable, frozen, hidden, targets, weights):
    # `hidden` is [student's | teacher's] hidden states; only the student's take a gradient.
    student = vocab_tiling.canonical_head(self.config)(trainable, None, hidden[:, :width])
    teacher = vocab_tiling.canonical_head(self.teacher.config)(frozen, None, jax.lax.stop_gradient(hidden[:, width:]))
    loss, ce, z_loss, kl = self._per_token(student, teacher, targets)
    return jnp.sum(loss * weights), {
        "z": jnp.sum(z_loss * weights),
        "ce": jnp.sum(ce * weights),
        "kl": jnp.sum(kl * weights),
    }

  def __call__(self, forward: Forward, batch, reference: Forward | None = None):
    inputs = (batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"])
    mask = (batch["targets_segmentation"] != 0).astype(jnp.float32)
    student_logits, intermediates = forward(*inputs)
    tiles = self.config.num_vocab_tiling
    if self.teacher is None:  # offline; config_rules keeps num_vocab_tiling at 1
      teacher_logits, tiles = (batch["teacher_values"], batch["teacher_indices"]), 1
    else:
      teacher_logits, teacher_intermediates = reference(*inputs)
    if tiles == 1:
      loss, ce, z_loss, kl = self._per_token(student_logits, teacher_logits, batch["targets"])
      total = jnp.sum(loss * mask)
      sums = {"z": jnp.sum(z_loss * mask), "ce": jnp.sum(ce * mask), "kl": jnp.sum(kl * mask)}
    else:
      # Neither model's logits are read: XLA drops both, and each tile makes its own.
      student_hidden = intermediates["decoder/hidden_states"]
      teacher_hidden = teacher_intermediates["decoder/hidden_states"]
      dtype = jnp.promote_types(student_hidden.dtype, teacher_hidden.dtype)
      hidden = jnp.concatenate([student_hidden.astype(dtype), teacher_hidden.astype(dtype)], axis=-1)
      total, sums = vocab_tiling.tiled_sums(
          functools.partial(self._tile_loss, student_hidden.shape[-1]),
          vocab_tiling.head_params(self.config, forward.canonical(forward.params)),
          vocab_tiling.head_params(self.teacher.config, reference.params),
          hidden,
          batch["targets"],
          mask,
          num_tiles=tiles,
      )
    extra = {}
    if self.beta:
      key = f"decoder/{attention.OUT_PROJECTION}"
      student_features, teacher_features = intermediates[key], teacher_intermediates[key]  # [L, B, T, D]
      if self.layers:
        layers = np.asarray(self.layers, np.int32)
        student_features, teacher_features = (jnp.take(f, layers, axis=0) for f in (student_features, teacher_features))
      # The mean over the chosen layers, then (CrossEntropy.total) over the loss's tokens: MaxText's reduction.
      feature = jnp.mean(feature_loss(student_features, teacher_features, self.config.distill_feature_loss_type), 0)
      extra["distill_feature"] = jnp.sum(feature * mask)
      total = total + self.beta * extra["distill_feature"]
    token_sum, aux = CrossEntropy.total(total, sums["z"], mask, intermediates)
    return token_sum, {**aux, "distill_kl": sums["kl"], "distill_ce": sums["ce"], **extra}


def feature_loss(student: jax.Array, teacher: jax.Array, kind: str) -> jax.Array:
  """Per vector, [..., D] x [..., D] -> [...] in float32, as MaxText's feature losses: "cosine",
  `optax.cosine_distance` with epsilon 1e-6, or "l2", the squared error averaged over D. The teacher's side
  takes no gradient."""
  student, teacher = student.astype(jnp.float32), jax.lax.stop_gradient(teacher.astype(jnp.float32))
  if kind == "cosine":
    return optax.cosine_distance(student, teacher, epsilon=1e-6)
  return jnp.mean(jnp.square(student - teacher), axis=-1)


def _check_feature_teacher(config: Config, teacher: Config) -> None:
  """The teacher has the student's width and the layers distill_layer_indices picks (all: as many as the
  student's), or a ConfigError naming the key at fault."""
  if teacher.emb_dim != config.emb_dim:
    raise ConfigError(
        f"distill_beta={config.distill_beta}: the feature loss compares the teacher's attention out-projection "
        f"outputs ({teacher.model_name}, emb_dim {teacher.emb_dim}) with the student's ({config.model_name}, "
        f"emb_dim {config.emb_dim}) element by element, as MaxText's does, with no projection between widths: "
        "give a teacher of the student's width, or set distill_beta=0"
    )
  layers = (teacher.num_decoder_layers, config.num_decoder_layers)
  if not config.distill_layer_indices and layers[0] != layers[1]:
    raise ConfigError(
        f"distill_layer_indices=null compares every layer, and the teacher ({teacher.model_name}) has {layers[0]} "
        f"layers, the student ({config.model_name}) {layers[1]}: list the layers to compare, each in "
        f"0..{min(layers) - 1}"
    )
  bad = [i for i in config.distill_layer_indices if i >= layers[0]]
  if bad:
    raise ConfigError(
        f"distill_layer_indices={list(config.distill_layer_indices)}: {bad} past the teacher's layers "
        f"({teacher.model_name}, num_decoder_layers={layers[0]}); each index picks the same layer in both "
        f"models, so it must be in 0..{min(layers) - 1}"
    )


# --- Offline teacher logits (`maxbridge distill-logits`, read back with `distill_logits_path`) ---

# The batch entries an offline run's loss reads: the teacher's k largest logits (float32) per token and their
# token ids (int32), [B, T, K].
OFFLINE_KEYS = ("teacher_values", "teacher_indices")
_META = "meta.json"
# What the batches the logits were written for are a function of, recorded in meta.json's "data" and compared with
# a student's: the keys a resume may not change either (`data.DATA_KEYS`, the one list), and the seed (the order
# rows are read in, the synthetic rows), the row length and the vocabulary, which a resume keeps by other means.
# The rows per step are meta.json's "rows".
PROVENANCE_KEYS = (*data.DATA_KEYS, "seed", "max_target_length", "vocab_size")
# What the teacher read of each batch, fingerprinted per step (meta.json's "tokens_sha256"): the logits are a
# function of these alone, so equal keys over a file replaced in place are still caught.
_TEACHER_INPUTS = ("inputs", "inputs_position", "inputs_segmentation")


def _step_file(folder: Path, step: int) -> Path:
  return folder / f"step_{step:08d}.npz"


def _recorded(config: Config) -> dict[str, Any]:
  """`PROVENANCE_KEYS` as meta.json holds them. A value naming an existing file or folder is its absolute path, so
  the same data spelled relative to another directory is the same; other values go through JSON (tuples as lists)."""
  values = {}
  for key in PROVENANCE_KEYS:
    value = getattr(config, key)
    if isinstance(value, str) and value and os.path.exists(value):
      value = os.path.abspath(value)
    values[key] = json.loads(json.dumps(value))
  return values


def tokens_sha256(batch: dict[str, np.ndarray]) -> str:
  """The fingerprint of what a teacher reads of `batch` (its token ids, positions and segments) as int32."""
  digest = hashlib.sha256()
  for key in _TEACHER_INPUTS:
    value = np.ascontiguousarray(batch[key], np.int32)
    digest.update(f"{key}{value.shape}".encode())
    digest.update(value.tobytes())
  return digest.hexdigest()


def write_logits(config: Config, destination: str | os.PathLike, *, top_k: int, steps: int, rows: int) -> Path:
  """Writes the teacher's top-k logits of the run's first `steps` training batches (`rows` rows each) as one
  folder, all or nothing: `meta.json` and one `step_XXXXXXXX.npz` (values, indices) per step.

  The batches are a pure function of the config (its data keys and seed) and
  the step, so a run of `config` with `distill_logits_path=destination` reads
  the logits of exactly the batches it trains on. `meta.json` records those keys
  (`PROVENANCE_KEYS`) and each step's `tokens_sha256`, which `OfflineLogits` checks.
  """
  destination = Path(destination)
  if destination.exists():
    raise FileExistsError(f"{destination} exists; give a new folder for the teacher's logits")
  if not 1 <= top_k <= config.vocab_size:
    raise ValueError(f"--top-k {top_k}: must be in [1, vocab_size={config.vocab_size}]")
  teacher = Teacher.for_student(config.replace(distill_logits_path=""))
  params = teacher.take_params()
  dataset = data.make_dataset(config, "train", rows)

  @jax.jit
  def top(params, tokens, positions, segment_ids):
    logits, _ = teacher.apply(params, None, tokens, positions, segment_ids)
    values, indices = jax.lax.top_k(logits.astype(jnp.float32), top_k)
    return values, indices.astype(jnp.int32)

  tmp = files.temp_dir_beside(destination, "distill-logits")
  try:
    fingerprints = []
    for step in range(steps):
      batch = dataset.batch(step)
      fingerprints.append(tokens_sha256(batch))
      values, indices = top(params, *(batch[key] for key in _TEACHER_INPUTS))
      np.savez(_step_file(tmp, step), teacher_values=np.asarray(values), teacher_indices=np.asarray(indices))
    meta = {
        "steps": steps,
        "top_k": top_k,
        "rows": rows,
        "max_target_length": config.max_target_length,
        "vocab_size": config.vocab_size,
        "teacher": teacher.source,
        "data": _recorded(config),
        "tokens_sha256": fingerprints,
    }
    (tmp / _META).write_text(json.dumps(meta, indent=2) + "\n")
    os.rename(tmp, destination)
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return destination


def _read_meta(path: Path) -> dict:
  if not (path / _META).is_file():
    raise ConfigError(
        f"distill_logits_path={path}: no {_META} there; write the teacher's logits with "
        "`maxbridge distill-logits CONFIG --top-k K --steps N OUT`"
    )
  return json.loads((path / _META).read_text())


def offline_shapes(config: Config, rows: int) -> dict[str, jax.ShapeDtypeStruct]:
  """The shapes of `OFFLINE_KEYS` in a batch of `rows` rows (ahead-of-time lowering; nothing else is read)."""
  shape = (rows, config.max_target_length, _read_meta(Path(config.distill_logits_path))["top_k"])
  return {
      "teacher_values": jax.ShapeDtypeStruct(shape, np.float32),
      "teacher_indices": jax.ShapeDtypeStruct(shape, np.int32),
  }


class OfflineLogits:
  """Reads a run's teacher logits from `distill_logits_path`; refuses, naming the path, a folder written for
  other batches (fewer steps, other rows or length, another vocabulary, any other of `PROVENANCE_KEYS`, or other
  tokens at a step) or one that does not record what it was written for."""

  def __init__(self, config: Config, rows: int, dataset):
    """`dataset`: the run's training batches (`data.make_dataset`'s), whose tokens the logits must be of."""
    self.path = Path(config.distill_logits_path)
    meta = _read_meta(self.path)
    # Refused rather than warned about: a folder written before meta.json recorded its data cannot be shown to
    # belong to this run, and on other batches the student trains silently on the wrong targets for the whole run
    # (a warning scrolls by in its log), while writing the logits again costs one teacher pass per step.
    missing = [key for key in ("data", "tokens_sha256") if key not in meta]
    if missing:
      raise ConfigError(
          f"distill_logits_path={self.path}: its {_META} does not record {' or '.join(map(repr, missing))} (what "
          "data and tokens the logits were written for: written by an earlier maxbridge), so nothing shows they are "
          "of this run's batches; write them again with `maxbridge distill-logits` for this run's config"
      )
    bad = [] if meta.get("rows") == rows else [f"rows {meta.get('rows')} (the run's: {rows})"]
    if meta.get("steps", 0) < config.steps:
      bad.append(f"steps {meta.get('steps')} (the run trains {config.steps})")
    ours = _recorded(config)
    bad += [
        f"{key} {meta['data'].get(key)!r} (the run's: {ours[key]!r})"
        for key in PROVENANCE_KEYS
        if not data.same_setting(key, meta["data"].get(key), ours[key])
    ]
    self._refuse(bad)
    self.fingerprints = meta["tokens_sha256"]
    # An in-memory dataset is a pure function of the step: every step the run trains is checked now, before the
    # first. A Grain dataset is read once, in order: each step as the loop reads it (`check_tokens`).
    self.checked = not dataset.stateful
    if self.checked:
      for step in range(config.steps):
        self._check(step, tokens_sha256(dataset.batch(step)))

  def _refuse(self, bad: list[str]) -> None:
    if bad:
      raise ConfigError(
          f"distill_logits_path={self.path} was written for other batches: {'; '.join(bad)}; write it again with "
          "`maxbridge distill-logits` for this run's config"
      )

  def _check(self, step: int, fingerprint: str) -> None:
    if step < len(self.fingerprints) and self.fingerprints[step] != fingerprint:
      written = self.fingerprints[step][:12]
      self._refuse(
          [
              f"the tokens of step {step} (the first of the run's that differs) have sha256 {written}... (the run's: "
              f"{fingerprint[:12]}...), though the recorded data keys agree: has the data changed in place?"
          ]
      )

  def check_tokens(self, step: int, rows: dict[str, np.ndarray], process_count: int = 1) -> None:
    """Refuses `step`'s `rows` (what the run's source just read) unless they are the tokens the logits were
    written for; a no-op where `__init__` checked every step. A process of several holds only its share of a
    Grain batch, and the fingerprint is of the whole: its recorded keys alone were checked."""
    if not self.checked and process_count == 1:
      self._check(step, tokens_sha256(rows))

  def batch(self, step: int, process_index: int = 0, process_count: int = 1) -> dict[str, np.ndarray]:
    """The teacher's entries of `step`'s batch, this process's contiguous rows (as `data` slices them)."""
    with np.load(_step_file(self.path, step)) as stored:
      arrays = {key: stored[key] for key in OFFLINE_KEYS}
    rows = len(arrays["teacher_values"]) // process_count
    return {key: value[process_index * rows : (process_index + 1) * rows] for key, value in arrays.items()}
