"""LoRA: low-rank adapters on chosen kernels, trained while the base model stays frozen.

The adapter math (this module) is the model's; the policy that trains them is
`maxbridge.training.trainable.LoraAdapters`.

A kernel `W` at canonical path `.../query/kernel` gets two adapters beside it,
`.../query/kernel_lora_a` (W's input axes + [r]) and `.../query/kernel_lora_b`
([r] + W's output axes), both with the layer axis where W has it when the
layers are scanned. Which axes are W's inputs its logical axes say (`in_ndim`),
for every family alike. The model runs on `W + lora_alpha / lora_rank * A @ B`.
`lora_b` starts at zero, so step 0 is the base model exactly.

Why not Qwix's `LoraProvider`: it finds a matmul's weights by the module that
runs it, so it cannot see through `ToNNX` / `ToLinen` (bridged flag mixes),
and it fails on `nnx.scan` stacks and on Linen einsum layers. Instead the
adapters are merged into the canonical tree before the forward pass (`merge`),
outside either backend: every flag combination, scanned or not, runs the same
model on the same adapted weights, with the same adapter names. The cost is
that the backward pass forms the full gradient of each adapted kernel before
reducing it to A and B; the optimizer state is the adapters' only.

A LoRA run's state holds the base parameters frozen (Linen: a `stored` field of
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
import zlib
import math
import re
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp

from maxbridge.core import canonical, initializers
from maxbridge.core.config import Config
from maxbridge.ops import quantization

SUFFIXES = ("_lora_a", "_lora_b")
COLLECTION = "lora"  # the adapters' collection in the Linen state and in checkpoints
REFERENCE_FILE = "lora_base.json"


def is_enabled(config: Config) -> bool:
  return config.lora_rank > 0


def scale(config: Config) -> float:
  return config.lora_alpha / config.lora_rank


def in_ndim(axes: Sequence[str | None]) -> int:
  """How many leading axes a kernel contracts, from its logical axes (one layer's: without the stack's axis).

  A kernel that writes the model's width (its last axis `embed`: attention's and
  linear attention's `out` [heads, head_dim, embed], an MLP's `wo` [mlp, embed])
  reads all its other axes; every other kernel reads its first axis (the width,
  or MLA's low-rank latent) and writes the rest ([heads, head_dim], [mlp] ...).
  """
  return len(axes) - 1 if len(axes) > 1 and axes[-1] == "embed" else 1


def _layer_axis(config: Config, path: str) -> int | None:
  return config.param_scan_axis if canonical.is_stacked(path) else None


def _input_axes(config: Config, kernel_axes: Mapping[str, Any]) -> dict[str, int]:
  """{a kernel's name (as stacked: `canonical.layer_of`): its `in_ndim`}, from a tree of logical axes scanned or
  not, so that it reads the kernels of a tree in either layout."""
  found = {}
  for path, axes in canonical.flatten(kernel_axes).items():
    axes = list(axes)
    if _layer_axis(config, path) is not None:
      del axes[_layer_axis(config, path)]
    found[_name(path)] = in_ndim(axes)
  return found


def _name(path: str) -> str:
  return (canonical.layer_of(path) or (path,))[0]


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


def _split(config: Config, path: str, shape: tuple, inputs: int) -> tuple[tuple, tuple, int | None]:
  """(input axes, output axes, layer axis or None) of a kernel's shape (or axis names), its first `inputs`
  per-layer axes being its input."""
  layer_axis = _layer_axis(config, path)
  per_layer = list(shape)
  if layer_axis is not None:
    del per_layer[layer_axis]
  return tuple(per_layer[:inputs]), tuple(per_layer[inputs:]), layer_axis


def _with_layer(shape: tuple, layer_axis: int | None, value: Any) -> tuple:
  if layer_axis is None:
    return tuple(shape)
  shape = list(shape)
  shape.insert(layer_axis, value)
  return tuple(shape)


def abstract_adapters(config: Config, abstract_params: Mapping[str, Any], kernel_axes: Mapping[str, Any]) -> dict:
  """The adapter tree (ShapeDtypeStructs) for the kernels `targets` selects; `kernel_axes` are the logical axes
  of `abstract_params`, which say each kernel's inputs."""
  flat_params = canonical.flatten(abstract_params)
  inputs = _input_axes(config, kernel_axes)
  flat = {}
  for path in targets(config, abstract_params):
    kernel = flat_params[path]
    ins, outs, layer_axis = _split(config, path, kernel.shape, inputs[_name(path)])
    layers = kernel.shape[layer_axis] if layer_axis is not None else None
    smaller = min(math.prod(ins), math.prod(outs))
    if config.lora_rank > smaller:  # A @ B would hold more values than the kernel, and reach no higher rank
      raise ValueError(
          f"lora_rank={config.lora_rank} exceeds the rank of {path}: its {math.prod(ins)} inputs x {math.prod(outs)} "
          f"outputs have rank at most {smaller}; set lora_rank <= {smaller} (or narrow lora_module_path)"
      )
    rank = (config.lora_rank,)
    flat[path + "_lora_a"] = jax.ShapeDtypeStruct(_with_layer(ins + rank, layer_axis, layers), kernel.dtype)
    flat[path + "_lora_b"] = jax.ShapeDtypeStruct(_with_layer(rank + outs, layer_axis, layers), kernel.dtype)
  return canonical.unflatten(flat)


def adapter_axes(config: Config, abstract_params: Mapping[str, Any], kernel_axes: Mapping[str, Any]) -> dict:
  """Logical axes of each adapter, from its kernel's: the rank axis is never sharded."""
  flat_axes = canonical.flatten(kernel_axes)
  inputs = _input_axes(config, kernel_axes)
  flat = {}
  for path in targets(config, abstract_params):
    axes = tuple(flat_axes[path])
    ins, outs, layer_axis = _split(config, path, axes, inputs[_name(path)])
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


def _contracted(config: Config, path: str, ndim: int, inputs: int) -> tuple[int, ...]:
  """The input axes of a kernel of `ndim` axes (stacked on param_scan_axis when its path is)."""
  layer_axis = _layer_axis(config, path)
  axes = [axis for axis in range(ndim) if axis != layer_axis]
  return tuple(axes[:inputs])


def _is_quantized(path: str, leaf: Any) -> bool:
  # Every kernel of the layer stacks (their matmul weights): the bulk of the base.
  return path.endswith("/kernel") and canonical.stack_name(path) is not None and len(leaf.shape) >= 2


def quantize_base(config: Config, params: Mapping[str, Any], kernel_axes: Mapping[str, Any]) -> dict:
  """The base as a QLoRA state holds it: each layer kernel as `kernel_qvalue` + `kernel_scale`; as is without QLoRA.

  `kernel_axes`: the model's logical axes (scanned or not), which say each kernel's inputs.
  """
  if not config.lora_weight_qtype:
    return params
  inputs = _input_axes(config, kernel_axes)
  flat = {}
  for path, leaf in canonical.flatten(params).items():
    if _is_quantized(path, leaf):
      contracted = _contracted(config, path, len(leaf.shape), inputs[_name(path)])
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
  inputs = _input_axes(config, kernel_axes)
  flat = {}
  for path, leaf in canonical.flatten(abstract_params).items():
    axes = tuple(flat_axes[path])
    if config.lora_weight_qtype and _is_quantized(path, leaf):
      contracted = _contracted(config, path, len(leaf.shape), inputs[_name(path)])
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
