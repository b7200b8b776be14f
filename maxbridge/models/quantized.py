"""Quantization at the model's level: Qwix's interception of a decoder, and a float tree made a serve tree.

Qwix (`use_qwix_quantization=true`) intercepts the matmuls of the decoder, so
layers need no hook at all: `dispatch` hands the decoder, in its own backend,
to `quantize_linen` or `quantize_nnx`. A serve model's parameters
(`checkpoint_is_quantized=true`) come from a float tree through `serve_tree`
(`dispatch.quantize_params`). The matmul hooks themselves (AQT, serving) are
`maxbridge.ops.quantization`'s.
"""

import functools
from typing import Any, Callable, Mapping

import flax.linen as nn
import qwix
from flax import nnx

from maxbridge.core import canonical
from maxbridge.core.config import Config
from maxbridge.core.quantization_policy import qwix_rules, uses_qwix
from maxbridge.ops import quantization


def quantize_linen(config: Config, decoder: nn.Module, decoder_path: str) -> nn.Module:
  """A Linen `decoder` with its matmuls intercepted by Qwix when `config` asks for Qwix, else `decoder`.

  `decoder_path`: "decoder" for a child of the Linen Transformer, "" for the
  root of a ToNNX (Linen paths start at the module `apply` runs).
  """
  if not uses_qwix(config) or config.checkpoint_is_quantized:  # serving: the layers hold frozen weights
    return decoder
  return qwix.quantize_model(decoder, qwix.QtProvider(qwix_rules(config, decoder_path)))


def quantize_nnx(config: Config, decoder: nnx.Module) -> nnx.Module:
  """An NNX `decoder` with its matmuls intercepted by Qwix when `config` asks for Qwix, else `decoder`.

  Qwix's setup forward pass is skipped: it only creates state (static
  activation scales, PTQ weights, LoRA), which these rules never ask for, and
  it would sow intermediates into the model. So the quantized decoder's state
  is the float decoder's; Qwix only adds static attributes to each module
  (`qwix_path`, `disable_quant_stats_update=False`, `qwix_rngs=None`).
  """
  if not uses_qwix(config) or config.checkpoint_is_quantized:  # serving: the layers hold frozen weights
    return decoder
  quantized = qwix.quantize_model(decoder, qwix.QtProvider(qwix_rules(config, "")), skip_nnx_init=True)
  intercepted = type(quantized)
  quantized.__class__ = type(
      intercepted.__name__, (intercepted,), {"__call__": _hiding_linen_modules(intercepted.__call__)}
  )
  return quantized


def _hiding_linen_modules(method: Callable) -> Callable:
  """`method` run with no Linen module current, so that Qwix finds the NNX module running each matmul.

  Qwix asks Linen's module stack before it looks for an NNX module in the
  call frames. Behind a ToLinen, that stack names the ToLinen for every
  matmul: its path is not the layer's, and its scope holds none of the
  layer's weights, so a weight would be taken for an activation (int4 then
  leaves it float).
  """

  @functools.wraps(method)
  def call(self, *args, **kwargs):
    stack = nn.module._context.module_stack  # pylint: disable=protected-access
    stack.append(None)
    try:
      return method(self, *args, **kwargs)
    finally:
      stack.pop()

  return call


def serve_tree(config: Config, params: Mapping[str, Any], serve_abstract: Mapping[str, Any]) -> dict[str, Any]:
  """A serve model's canonical tree from a float tree in the same scan form (AQT convert mode).

  `serve_abstract` is the serve model's abstract tree: a `kernel_qvalue` there
  takes the float `kernel` beside it, quantized over the axes its
  `kernel_scale` holds as 1; every other leaf is copied.
  """
  if quantization.is_serve_tree(params):
    raise ValueError("these parameters are already quantized (they hold kernel_qvalue/kernel_scale, not float kernels)")
  flat, want = canonical.flatten(params), canonical.flatten(serve_abstract)
  out = {}
  for path, leaf in want.items():
    name = path.removesuffix(quantization.QVALUE_SUFFIX)
    if name == path:
      if not (
          path.endswith(quantization.SCALE_SUFFIX)
          and path.removesuffix(quantization.SCALE_SUFFIX) + quantization.QVALUE_SUFFIX in want
      ):
        out[path] = flat[path]
      continue
    scale = want[name + quantization.SCALE_SUFFIX]
    contracted = tuple(i for i, n in enumerate(scale.shape) if n == 1)
    out[path], out[name + quantization.SCALE_SUFFIX] = quantization.quantize_kernel(config, flat[name], contracted)
  return canonical.unflatten(out)
