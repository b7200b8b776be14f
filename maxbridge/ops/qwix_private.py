"""The few parts of Qwix's private API (`qwix._src.core`) this project calls, and the only module importing them.

Why private: Qwix's public API quantizes a model by intercepting its matmuls
(`qwix.QtRule`, `qwix.quantize_model`, what QAT uses). Serving needs its
array-level pieces instead: a kernel quantized once over the axes we choose
(Qwix's own PTQ of a scanned stack would take the layer axis for a contracted
one, sharing one scale across layers), and the matmuls of a frozen (qvalue,
scale); QLoRA stores its frozen base as Qwix's NF4 codes. A Qwix release that
moves them breaks this module alone.
"""

from typing import Any, Mapping, Sequence

import jax
from qwix._src.core import dot_general as _dot_general
from qwix._src.core import qarray as _qarray
from qwix._src.core import ragged_dot as _ragged_dot

QArray = _qarray.QArray  # a quantized array: qvalue, scale (and zero point), qtype


def quantize(
    array: jax.Array,
    qtype: Any,
    channelwise_axes: Sequence[int],
    *,
    tiled_axes: Mapping[int, int] | None = None,
    calibration_method: str | None = None,
) -> QArray:
  """`array` quantized to `qtype`, one scale per index of `channelwise_axes` (and per tile of `tiled_axes`);
  `calibration_method` as Qwix spells it (its default, "absmax", when None)."""
  how = dict(qtype=qtype, channelwise_axes=channelwise_axes)
  if tiled_axes is not None:
    how["tiled_axes"] = tiled_axes
  if calibration_method is not None:
    how["calibration_method"] = calibration_method
  return _qarray.quantize(array, _qarray.HowToQuantize(**how))


def frozen(qvalue: jax.Array, scale: jax.Array, qtype: Any) -> QArray:
  """A stored (qvalue, scale) pair as the quantized weight Qwix's matmuls take."""
  return _qarray.QArray(qvalue=qvalue, scale=scale, qtype=qtype)


def dequantize(qvalue: jax.Array, scale: jax.Array, qtype: Any) -> jax.Array:
  """The float array (in the scale's dtype) that a stored (qvalue, scale) stands for."""
  return _qarray.dequantize(_qarray.QArray(qvalue, scale, None, qtype))


def quantize_lhs(
    lhs: jax.Array, dimension_numbers, rhs_ndim: int, qtype: Any, tile_size, calibration_method: str
) -> QArray:
  """A matmul's activations quantized on the fly, as Qwix's `PtqProvider` quantizes them for a quantized weight."""
  how = _dot_general.get_how_to_quantize(
      dimension_numbers=dimension_numbers,
      ndims=(lhs.ndim, rhs_ndim),
      for_lhs=True,
      tile_size=tile_size,
      qtype=qtype,
      calibration_method=calibration_method,
  )
  return _qarray.quantize(lhs, how)


def dot_general(lhs: jax.Array | QArray, weight: QArray, dimension_numbers) -> jax.Array:
  """Qwix's `dot_general` of (possibly quantized) activations and a quantized weight."""
  return _dot_general.dot_general(lhs, weight, dimension_numbers)


def ragged_dot(lhs: jax.Array | QArray, weight: QArray, group_sizes: jax.Array) -> jax.Array:
  """Qwix's `ragged_dot` (dropless experts) of (possibly quantized) activations and quantized expert weights."""
  return _ragged_dot.ragged_dot(lhs, weight, group_sizes)
