"""LoRA: low-rank adapters on chosen kernels, trained while the base model stays frozen.

A kernel `W` at canonical path `.../query/kernel` gets two adapters beside it,
`.../query/kernel_lora_a` (W's input axes + [r]) and `.../query/kernel_lora_b`
([r] + W's output axes), both with the layer axis where W has it when the
layers are scanned. The model runs on `W + lora_alpha / lora_rank * A @ B`.
`lora_b` starts at zero, so step 0 is the base model exactly.

Why not Qwix's `LoraProvider`: it finds a matmul's weights by the module that
runs it, so it cannot see through `ToNNX` / `ToLinen` (bridged flag mixes),
and it fails on `nnx.scan` stacks and on Linen einsum layers. Instead the
adapters are merged into the canonical tree before the forward pass (`merge`),
outside either backend: every flag combination, scanned or not, runs the same
model on the same adapted weights, with the same adapter names. The cost is
that the backward pass forms the full gradient of each adapted kernel before
reducing it to A and B; the optimizer state is the adapters' only.

A LoRA run's state holds the base parameters frozen (Linen: a `base` field of
the `TrainState`; NNX: the model's `nnx.Param`s, the adapters being
`nnx.LoRAParam`s of their own module that the `nnx.Optimizer` alone sees).
Its checkpoints hold the adapters, their optimizer state and the step:

    {"params": {"lora": <adapter tree>}, "opt_state": [adam {count, mu: {"lora": ...}, nu}, None, {count}],
     "step": int32}

and the run folder's `lora_base.json` names the base (`load_parameters_path`,
or the seed) with a fingerprint of its values, checked on resume and by
`maxbridge lora-merge`.

QLoRA (`lora_weight_qtype`): the state holds the base with every kernel of the
layer stacks as `kernel_qvalue` + `kernel_scale` (int8 per output channel, or
NF4 codes with per-block absmax scales: `quantization.quantize_weight`), the
canonical names serving uses; embeddings, norms and the output head stay
float, as in the QLoRA paper. Each forward pass dequantizes the base and
merges the float adapters in, so only the adapters' gradients and optimizer
state exist. The base's fingerprint is that of its dequantized values.

Dropout (`lora_dropout`): merged adapters see no per-token input to drop, but
input dropout commutes with A when the mask is shared by the tokens:
(x * m) @ A == x @ (m[:, None] * A). So each train step draws one mask over
each adapter's input features (per layer), from the seed and the step alone,
and merges the dropped-out A; every token of the step (every micro-batch too)
sees the same mask. Both backends, scanned or not, draw the same masks. Eval
steps and serving use all inputs.
"""

import functools
import hashlib
import zlib
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.training import train_state
from jax.sharding import Mesh

from maxbridge import canonical, checkpointing, files, initializers, layouts, quantization
from maxbridge.config import Config
from maxbridge.model import LinenModel, NNXModel, linen_forward, nnx_forward
from maxbridge.state import Bound, LinenTrainer, NNXTrainer, Params, int32_disk_step, int32_step

SUFFIXES = ("_lora_a", "_lora_b")
COLLECTION = "lora"  # the adapters' collection in the Linen state and in checkpoints
REFERENCE_FILE = "lora_base.json"


def is_enabled(config: Config) -> bool:
  return config.lora_rank > 0


def scale(config: Config) -> float:
  return config.lora_alpha / config.lora_rank


def in_ndim(path: str) -> int:
  """Input axes of a kernel (canonical, unscanned): attention's output projection reads heads and head_dim."""
  return 2 if path.endswith("self_attention/out/kernel") else 1


def targets(config: Config, abstract_params: Mapping[str, Any]) -> list[str]:
  """Canonical paths (as in `abstract_params`) of the kernels `lora_module_path` selects.

  The regex must match a whole path, with layers named as stacked
  (`decoder/layers/...`, never `layers_3`), so that a scanned and an unscanned
  run adapt the same kernels.
  """
  pattern = re.compile(config.lora_module_path)
  found = []
  for path, leaf in canonical.flatten(abstract_params).items():
    layer = canonical.layer_of(path)
    name = layer[0] if layer else path
    if path.endswith("/kernel") and len(leaf.shape) >= 2 and pattern.fullmatch(name):
      found.append(path)
  if not found:
    kernels = sorted(
        {(canonical.layer_of(p) or (p,))[0] for p in canonical.flatten(abstract_params) if p.endswith("kernel")}
    )
    raise ValueError(
        f"lora_module_path={config.lora_module_path!r} matches no kernel of {config.model_name}; it must fully match "
        f"canonical kernel paths such as: {', '.join(kernels[:8])}"
    )
  return found


def _split(config: Config, path: str, shape: tuple[int, ...]) -> tuple[tuple, tuple, int | None]:
  """(input axes, output axes, layer axis or None) of a kernel's shape."""
  layer_axis = config.param_scan_axis if canonical.is_stacked(path) else None
  per_layer = list(shape)
  if layer_axis is not None:
    del per_layer[layer_axis]
  n = in_ndim((canonical.layer_of(path) or (path,))[0])
  return tuple(per_layer[:n]), tuple(per_layer[n:]), layer_axis


def _with_layer(shape: tuple, layer_axis: int | None, value: Any) -> tuple:
  if layer_axis is None:
    return tuple(shape)
  shape = list(shape)
  shape.insert(layer_axis, value)
  return tuple(shape)


def abstract_adapters(config: Config, abstract_params: Mapping[str, Any]) -> dict:
  """The adapter tree (ShapeDtypeStructs) for the kernels `targets` selects."""
  flat_params = canonical.flatten(abstract_params)
  flat = {}
  for path in targets(config, abstract_params):
    kernel = flat_params[path]
    ins, outs, layer_axis = _split(config, path, kernel.shape)
    layers = kernel.shape[layer_axis] if layer_axis is not None else None
    rank = (config.lora_rank,)
    flat[path + "_lora_a"] = jax.ShapeDtypeStruct(_with_layer(ins + rank, layer_axis, layers), kernel.dtype)
    flat[path + "_lora_b"] = jax.ShapeDtypeStruct(_with_layer(rank + outs, layer_axis, layers), kernel.dtype)
  return canonical.unflatten(flat)


def adapter_axes(config: Config, abstract_params: Mapping[str, Any], kernel_axes: Mapping[str, Any]) -> dict:
  """Logical axes of each adapter, from its kernel's: the rank axis is never sharded."""
  flat_axes = canonical.flatten(kernel_axes)
  flat = {}
  for path in targets(config, abstract_params):
    axes = tuple(flat_axes[path])
    ins, outs, layer_axis = _split(config, path, axes)
    layer_name = axes[layer_axis] if layer_axis is not None else None
    flat[path + "_lora_a"] = _with_layer(ins + (None,), layer_axis, layer_name)
    flat[path + "_lora_b"] = _with_layer((None,) + outs, layer_axis, layer_name)
  return canonical.unflatten(flat)


def init_adapters(abstract: Mapping[str, Any], seed: int | jax.Array, config: Config) -> dict:
  """A: fan-in scaled over its input axes (from the seed and the adapter's path); B: zeros."""
  return initializers.init_params(abstract, seed, initializers.InitOptions.from_config(config))


def _delta(a: jax.Array, b: jax.Array, layer_axis: int | None) -> jax.Array:
  if layer_axis is None:
    return jnp.tensordot(a, b, axes=1)
  a, b = jnp.moveaxis(a, layer_axis, 0), jnp.moveaxis(b, layer_axis, 0)
  return jnp.moveaxis(jax.vmap(functools.partial(jnp.tensordot, axes=1))(a, b), 0, layer_axis)


def merge(config: Config, params: Mapping[str, Any], adapters: Mapping[str, Any]) -> dict:
  """`params` with every adapted kernel replaced by W + alpha/r * A @ B (in float32, stored in W's dtype).

  Traceable and differentiable in both arguments; the forward pass of a LoRA
  run and `maxbridge lora-merge` both call it.
  """
  flat = canonical.flatten(params)
  flat_adapters = canonical.flatten(adapters)
  for path in [p[: -len("_lora_a")] for p in flat_adapters if p.endswith("_lora_a")]:
    if path not in flat:
      raise ValueError(f"adapter {path}_lora_a has no kernel {path} in the base parameters")
    kernel = flat[path]
    a, b = flat_adapters[path + "_lora_a"], flat_adapters[path + "_lora_b"]
    layer_axis = config.param_scan_axis if canonical.is_stacked(path) else None
    delta = _delta(jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32), layer_axis)
    if delta.shape != kernel.shape:
      raise ValueError(f"adapters of {path} give shape {delta.shape}, the kernel has {tuple(kernel.shape)}")
    flat[path] = (jnp.asarray(kernel, jnp.float32) + scale(config) * delta).astype(kernel.dtype)
  return canonical.unflatten(flat)


def _contracted(config: Config, path: str, ndim: int) -> tuple[int, ...]:
  """The input axes of a kernel of `ndim` axes (stacked on param_scan_axis when its path is)."""
  layer_axis = config.param_scan_axis if canonical.is_stacked(path) else None
  axes = [axis for axis in range(ndim) if axis != layer_axis]
  return tuple(axes[: in_ndim((canonical.layer_of(path) or (path,))[0])])


def _is_quantized(path: str, leaf: Any) -> bool:
  # Every kernel of the layer stacks (their matmul weights): the bulk of the base.
  return path.endswith("/kernel") and canonical.stack_name(path) is not None and len(leaf.shape) >= 2


def quantize_base(config: Config, params: Mapping[str, Any]) -> dict:
  """The base as a QLoRA state holds it: each layer kernel as `kernel_qvalue` + `kernel_scale`; as is without QLoRA."""
  if not config.lora_weight_qtype:
    return params
  flat = {}
  for path, leaf in canonical.flatten(params).items():
    if _is_quantized(path, leaf):
      contracted = _contracted(config, path, len(leaf.shape))
      flat[path + "_qvalue"], flat[path + "_scale"] = quantization.quantize_weight(
          leaf, config.lora_weight_qtype, contracted
      )
    else:
      flat[path] = leaf
  return canonical.unflatten(flat)


def dequantize_base(config: Config, stored: Mapping[str, Any]) -> dict:
  """The float canonical base (weight_dtype) of what `quantize_base` stores."""
  if not config.lora_weight_qtype:
    return stored
  flat = canonical.flatten(stored)
  out = {}
  for path, leaf in flat.items():
    if path.endswith("/kernel_qvalue"):
      kernel = path[: -len("_qvalue")]
      value = quantization.dequantize_weight(leaf, flat[kernel + "_scale"], config.lora_weight_qtype)
      out[kernel] = value.astype(config.weight_dtype)
    elif not path.endswith("/kernel_scale"):
      out[path] = leaf
  return canonical.unflatten(out)


def stored_axes(config: Config, abstract_params: Mapping[str, Any], kernel_axes: Mapping[str, Any]) -> dict:
  """Logical axes of the stored base: a qvalue keeps its kernel's; a scale's input axes are never sharded."""
  flat_axes = canonical.flatten(kernel_axes)
  flat = {}
  for path, leaf in canonical.flatten(abstract_params).items():
    axes = tuple(flat_axes[path])
    if config.lora_weight_qtype and _is_quantized(path, leaf):
      contracted = _contracted(config, path, len(leaf.shape))
      flat[path + "_qvalue"] = axes
      flat[path + "_scale"] = tuple(None if i in contracted else name for i, name in enumerate(axes))
    else:
      flat[path] = axes
  return canonical.unflatten(flat)


def dropout_key(config: Config, step: jax.Array) -> jax.Array:
  """The key of a train step's adapter dropout: the seed and the step only, so both backends draw alike."""
  return jax.random.fold_in(jax.random.key(config.seed), jnp.asarray(step, jnp.uint32))


def drop_adapter_inputs(config: Config, adapters: Mapping[str, Any], key: jax.Array) -> dict:
  """`adapters` with each A's rows (input features) dropped with probability lora_dropout, the kept ones scaled
  by 1 / (1 - lora_dropout): what dropout of the adapter's input, one mask for all tokens, computes.

  A layer's mask comes from the key, the adapter's stacked path and the layer
  index, so that a scanned stack and its unscanned layers draw the same masks.
  """
  keep = 1.0 - config.lora_dropout
  flat = dict(canonical.flatten(adapters))
  for path in [p for p in flat if p.endswith("_lora_a")]:
    a = flat[path]
    name, index = canonical.layer_of(path) or (path, None)
    path_key = jax.random.fold_in(key, zlib.crc32(name.encode()))
    layer_axis = config.param_scan_axis if canonical.is_stacked(path) else None
    per_layer = list(a.shape)
    if layer_axis is not None:
      del per_layer[layer_axis]
    per_layer[-1] = 1  # one draw per input feature, shared by the rank axis
    if layer_axis is None:
      mask = jax.random.bernoulli(jax.random.fold_in(path_key, index or 0), keep, per_layer)
    else:
      layers = [
          jax.random.bernoulli(jax.random.fold_in(path_key, i), keep, per_layer) for i in range(a.shape[layer_axis])
      ]
      mask = jnp.stack(layers, axis=layer_axis)
    flat[path] = jnp.where(mask, a / jnp.asarray(keep, a.dtype), jnp.zeros((), a.dtype))
  return canonical.unflatten(flat)


# --- the base model's identity ----------------------------------------------------


def fingerprint(params: Mapping[str, Any], param_scan_axis: int) -> str:
  """A digest of the parameter values, path by path, the same whether the layers are scanned or not."""
  host = jax.device_get(params)
  digest = hashlib.sha256()
  for path, leaf in sorted(canonical.flatten(canonical.unstack_layers(host, param_scan_axis)).items()):
    array = np.ascontiguousarray(leaf)
    digest.update(f"{path}:{array.dtype}:{array.shape}\n".encode())
    digest.update(array.tobytes())
  return digest.hexdigest()[:24]


def base_reference(config: Config, params: Mapping[str, Any]) -> dict:
  """What a LoRA run's adapters were trained on: the base's source and the fingerprint of its values."""
  source = os.path.abspath(config.load_parameters_path) if config.load_parameters_path else f"seed {config.seed}"
  return {"base": source, "fingerprint": fingerprint(params, config.param_scan_axis)}


def check_base(run_dir: Path, reference: dict) -> None:
  """Refuses to resume a LoRA run on another base than the one its adapters were trained on."""
  path = Path(run_dir) / REFERENCE_FILE
  if not path.is_file():
    return
  saved = json.loads(path.read_text())
  if saved["fingerprint"] != reference["fingerprint"]:
    raise checkpointing.CheckpointError(
        f"{run_dir}: its adapters were trained on base {saved['base']} (fingerprint {saved['fingerprint']}), "
        f"but this run's base is {reference['base']} (fingerprint {reference['fingerprint']}); resume with "
        "the original base (load_parameters_path), or start a new run_name"
    )


def write_reference(run_dir: Path, reference: dict) -> None:
  files.write_text(Path(run_dir) / REFERENCE_FILE, json.dumps(reference, indent=2) + "\n")


# --- the trainers ---------------------------------------------------------------


def disk_layout(tx, adapters: Mapping[str, Any]) -> dict:
  """An adapter checkpoint's tree (abstract), the same for both backends."""
  params = {COLLECTION: adapters}
  return {
      "params": params,
      "opt_state": layouts.optax_to_tree(jax.eval_shape(tx.init, params)),
      "step": jax.ShapeDtypeStruct((), jnp.int32),
  }


class LoraTrainState(train_state.TrainState):
  """flax's TrainState over {"lora": adapters}; the base parameters ride along, never updated."""

  base: Any = None  # {"params": canonical base tree}


class _LoraMixin:
  """What both backends' LoRA trainers share: the adapter tree, the merged view, the adapter checkpoint."""

  saves_params = False  # checkpoints hold the adapters only: the base comes from where the run started

  def _setup_adapters(self, config: Config, abstract_params: dict, kernel_axes: dict) -> None:
    self.abstract_adapters = abstract_adapters(config, abstract_params)
    self.adapter_axes = adapter_axes(config, abstract_params, kernel_axes)
    # The base as the state holds it (QLoRA: quantized kernels; otherwise the canonical tree itself).
    self.abstract_stored = jax.eval_shape(functools.partial(quantize_base, config), abstract_params)
    self.stored_axes = stored_axes(config, abstract_params, kernel_axes)

  def _init_adapters(self, seed) -> dict:
    return init_adapters(self.abstract_adapters, seed, self.config)

  @functools.cached_property
  def disk_layout(self) -> dict:
    return disk_layout(self.tx, self.abstract_adapters)

  def _adapted(self, bound: Bound, stored: Params, adapters: Params) -> Params:
    """The canonical parameters a forward pass runs on: the (dequantized) base with the adapters merged in,
    their inputs dropped out in a train step."""
    if bound.training and self.config.lora_dropout:
      adapters = drop_adapter_inputs(self.config, adapters, dropout_key(self.config, bound.step))
    return merge(self.config, dequantize_base(self.config, stored), adapters)

  def _canonical_view(self, bound: Bound, params) -> Params:
    # What losses that read the model directly (vocabulary tiling's head) see: the adapted weights.
    return self._adapted(bound, self._stored(bound), self._canonical(params))

  def params(self, state) -> Params:
    """The canonical base of a state (QLoRA: its dequantized values)."""
    return canonical.unflatten(canonical.flatten(dequantize_base(self.config, self.stored_base(state))))

  def _reference_params(self, bound: Bound, reference: Params):
    # A frozen reference model (DPO's) is the base: the adapters off, as zeros give a zero update.
    del reference
    return jax.tree.map(jnp.zeros_like, bound.params)

  # So the reference needs no copy of the base (a float one, under QLoRA): an empty stand-in is passed.
  _reference_shardings = None

  def set_reference(self, state) -> None:
    del state
    self.reference = {}

  def _reference_arg(self, abstract: bool = False):
    del abstract
    return {} if self.loss.frozen_reference else None

  def adapted_params(self, state) -> Params:
    """The canonical parameters the model runs on: the base with every adapter merged in."""
    bound = self._bind(state)
    return self._canonical_view(bound, bound.params)

  def model_params(self, state) -> Params:
    return self.adapted_params(state)

  def adapters(self, state) -> dict:
    """The canonical adapter tree of a state."""
    return self.to_checkpoint(state)["params"][COLLECTION]


class LinenLoraTrainer(_LoraMixin, LinenTrainer):
  """Linen LoRA: the TrainState's params (and so its optimizer) are {"lora": adapters}; the base is `state.base`."""

  def __init__(self, config: Config, model: LinenModel, mesh: Mesh | None = None, **hooks):
    super().__init__(config, model, mesh, **hooks)
    self._setup_adapters(config, self.abstract_params, model.logical_axes())

  def trainable(self, config: Config) -> str:
    return COLLECTION

  def _create(self, stored: dict, adapters: dict | None = None) -> LoraTrainState:
    return int32_step(
        LoraTrainState.create(
            apply_fn=self.model.apply, params={COLLECTION: adapters}, tx=self.tx, base={"params": stored}
        )
    )

  def abstract_state(self):
    return jax.eval_shape(self._create, self.abstract_stored, self.abstract_adapters)

  def _init(self, seed):
    return self._create(quantize_base(self.config, self._initial_params(seed)), self._init_adapters(seed))

  def logical_specs(self):
    def box(abstract, axes):
      return jax.tree.map(lambda leaf, names: nn.LogicallyPartitioned(leaf, names), abstract, axes)

    base = box(self.abstract_stored, self.stored_axes) if self.config.lora_weight_qtype else self.model.boxed_params()
    boxed = box(self.abstract_adapters, self.adapter_axes)
    return nn.get_partition_spec(jax.eval_shape(self._create, base, boxed))

  def stored_base(self, state) -> dict:
    """The base as the state holds it (QLoRA: `kernel_qvalue` + `kernel_scale` per layer kernel)."""
    return state.base["params"]

  def _replace_params(self, state, params: Params):
    return state.replace(base={**state.base, "params": quantize_base(self.config, params)})

  def with_checkpoint(self, state, tree: dict):
    """`state` (its base) with the adapters, optimizer state and step of an adapter checkpoint."""
    return state.replace(
        params=tree["params"],
        opt_state=layouts.optax_from_tree(state.opt_state, tree["opt_state"]),
        step=jnp.asarray(tree["step"], jnp.int32),
    )

  def _bind(self, state) -> Bound:
    return Bound(params=state.params, frozen=state.base, step=state.step, handle=state)

  def _stored(self, bound: Bound) -> Params:
    return bound.frozen["params"]

  def _canonical(self, params) -> Params:
    return params[COLLECTION]

  def _forward(self, bound, params, frozen, tokens, positions, segment_ids):
    merged = self._adapted(bound, frozen["params"], params[COLLECTION])
    return linen_forward(self.model.module, {**frozen, "params": merged}, tokens, positions, segment_ids)


class Adapters(nnx.Module):
  """A canonical adapter tree as `nnx.LoRAParam`s (or `variable`s), one submodule per path level."""

  def __init__(self, tree: Mapping[str, Any], axes: Mapping[str, Any], variable: type = nnx.LoRAParam):
    for name, value in tree.items():
      if isinstance(value, Mapping):
        setattr(self, name, Adapters(value, axes[name], variable))
      else:
        setattr(self, name, variable(value, out_sharding=tuple(axes[name])))


class LoraTrainStateNNX(nnx.Module):
  """The NNX LoRA train state: the frozen model, its adapters, and an optimizer over the adapters only.

  Under QLoRA `model` is the stored base (`Adapters` of `nnx.Param`s in the
  canonical tree, quantized kernels included): the model's float kernels
  exist only inside a forward pass.
  """

  def __init__(self, model: nnx.Module, adapters: Adapters, optimizer: nnx.Optimizer):
    self.model = model
    self.adapters = adapters
    self.optimizer = optimizer


def _nnx_path(disk_path: str) -> str:
  """An adapter checkpoint's path -> the same leaf's path in `LoraTrainStateNNX`'s pure dict."""
  if disk_path == "step":
    return "optimizer/step"
  if disk_path.startswith("params/lora/"):
    return "adapters/" + disk_path[len("params/lora/") :]
  return "optimizer/" + re.sub(r"/(mu|nu)/lora/", r"/\1/", disk_path)


class NNXLoraTrainer(_LoraMixin, NNXTrainer):
  """NNX LoRA: adapters are `nnx.LoRAParam`s beside the model; `nnx.Optimizer(adapters, wrt=nnx.LoRAParam)`."""

  def __init__(self, config: Config, build_model: Callable[[nnx.Rngs], nnx.Module], mesh: Mesh | None = None, **hooks):
    abstract_model = NNXModel(config, nnx.eval_shape(lambda: build_model(nnx.Rngs(params=0))))
    self.config = config
    self._setup_adapters(config, abstract_model.abstract_params(), abstract_model.logical_axes())
    # QLoRA runs the model from its graph definition and a Param state filled with the merged weights.
    self._model_graphdef, self._model_params, rest = nnx.split(abstract_model.module, nnx.Param, ...)
    if config.lora_weight_qtype and jax.tree.leaves(rest):
      raise ValueError(
          f"lora_weight_qtype={config.lora_weight_qtype!r}: QLoRA stores the base outside the model, whose state "
          f"must be its parameters only; this model also holds {sorted(nnx.to_pure_dict(rest))}"
      )
    super().__init__(config, build_model, mesh, **hooks)

  def trainable(self, config: Config) -> nnx.filterlib.Filter:
    return nnx.LoRAParam

  def _create(self, seed) -> LoraTrainStateNNX:
    if self.config.lora_weight_qtype:
      model = Adapters(quantize_base(self.config, self._initial_params(seed)), self.stored_axes, nnx.Param)
    else:
      model = self.build_model(nnx.Rngs(params=0))
      nnx.update(model, self._initial_params(seed))
    adapters = Adapters(self._init_adapters(seed), self.adapter_axes)
    return LoraTrainStateNNX(model, adapters, nnx.Optimizer(adapters, self.tx, wrt=nnx.LoRAParam))

  def to_checkpoint(self, state) -> dict:
    flat = {layouts.keypath_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(state))[0]}
    tree = jax.tree_util.tree_map_with_path(lambda path, _: flat[_nnx_path(layouts.keypath_str(path))], self.disk_layout)
    return int32_disk_step(tree)

  def with_checkpoint(self, state, tree: dict):
    pure: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
      *parents, name = _nnx_path(layouts.keypath_str(path)).split("/")
      node = pure
      for key in parents:
        node = node.setdefault(int(key) if key.isdigit() else key, {})
      node[name] = leaf
    pure["optimizer"]["step"] = jnp.asarray(pure["optimizer"]["step"], jnp.uint32)
    state = jax.tree.map(lambda x: x, state)  # a fresh State: the caller's stays as it was
    nnx.replace_by_pure_dict(state, pure)
    return state

  def _bind(self, state) -> Bound:
    # No copy, as in NNXTrainer._bind: the optimizer update writes into these Variables and is read back from them.
    opened = nnx.merge(self.graphdef, state)
    model_graphdef, base, rest = nnx.split(opened.model, nnx.Param, ...)
    if self.config.lora_weight_qtype:  # `opened.model` is the stored base, not the model
      model_graphdef = self._model_graphdef
    _, adapters = nnx.split(opened.adapters, nnx.LoRAParam)
    return Bound(params=adapters, frozen=(base, rest), step=opened.optimizer.step[...], handle=(opened, model_graphdef))

  def _stored(self, bound: Bound) -> Params:
    return nnx.to_pure_dict(bound.frozen[0])

  def stored_base(self, state) -> dict:
    """The base as the state holds it (QLoRA: `kernel_qvalue` + `kernel_scale` per layer kernel)."""
    return canonical.unflatten(canonical.flatten(nnx.to_pure_dict(state)["model"]))

  def _replace_params(self, state, params: Params):
    return super()._replace_params(state, quantize_base(self.config, params))

  def _forward(self, bound, params, frozen, tokens, positions, segment_ids):
    _, model_graphdef = bound.handle
    base, rest = frozen
    merged = self._adapted(bound, nnx.to_pure_dict(base), nnx.to_pure_dict(params))
    if self.config.lora_weight_qtype:  # the model's Param state; `rest` is empty (checked in __init__)
      base = self._model_params
    base = jax.tree.map(lambda x: x, base)  # a fresh State to fill: `frozen` is read by every micro-batch
    nnx.replace_by_pure_dict(base, merged)
    return nnx_forward(model_graphdef, base, rest, tokens, positions, segment_ids)

  def _apply_update(self, bound, grads):
    opened, _ = bound.handle
    opened.optimizer.update(opened.adapters, grads)
    return nnx.state(opened, nnx.Not(nnx.Intermediate))
