"""Checkpoint conversion between backends and layouts (Linen, NNX, scanned, MaxText), and comparison.

On disk (streaming, array by array; also the `maxbridge convert` and
`maxbridge compare` verbs):

    converters.convert(src, dst, layout="nnx", scan_layers=False)  # -> Conversion
    converters.compare(a, b, atol=0, rtol=0)                        # -> Comparison
    params, info = converters.load_params(path)                     # canonical tree + what was found
    converters.verify(run_or_step)                                  # -> [StepCheck], arrays vs their digests

In memory:

    converters.to_linen(tree)  /  converters.to_nnx(tree)    # any layout in; see their docstrings
    converters.stack_layers(params, axis)  /  converters.unstack_layers(params, axis)
    converters.detect_layout(tree_or_metadata_or_path)      # -> Layout; .describe() in words

The layouts and the one mapping between their paths: `maxbridge.core.layouts`; reading
any checkpoint array by array: `maxbridge.core.checkpointing` (the core needs both and
never imports this package). A checkpoint that cannot be read, converted or
written raises `CheckpointError` (`ConversionError` and `PlanError` are kinds of
it); a tree in memory in no known layout raises `LayoutError`.
"""

from converters.compare import Comparison, compare
from converters.convert import Conversion, convert
from converters.errors import ConversionError
from converters.plan import PlanError
from converters.trees import detect_layout, to_linen, to_nnx
from converters.verify import StepCheck, verify
from maxbridge.core.canonical import stack_layers, unstack_layers
from maxbridge.core.checkpointing import CheckpointError, CheckpointInfo, load_params
from maxbridge.core.layouts import Layout, LayoutError

__all__ = [
    "CheckpointError",
    "CheckpointInfo",
    "Comparison",
    "Conversion",
    "ConversionError",
    "Layout",
    "LayoutError",
    "PlanError",
    "StepCheck",
    "compare",
    "convert",
    "detect_layout",
    "load_params",
    "stack_layers",
    "to_linen",
    "to_nnx",
    "unstack_layers",
    "verify",
]
