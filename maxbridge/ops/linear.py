"""Projections: contract the trailing axes of x with the leading axes of a kernel.

Every weight matmul goes through an injectable `dot_general` (as in flax's
`Linear`), with operands cast by flax's `promote_dtype`: AQT replaces the
`dot_general`, Qwix intercepts `jax.lax.dot_general` and `promote_dtype`.
"""

from typing import Callable

import jax
import jax.numpy as jnp
from flax.nnx.nn.dtypes import promote_dtype

DotGeneral = Callable[..., jax.Array]


def dense_general(
    x: jax.Array,
    kernel: jax.Array,
    *,
    in_ndim: int,
    dtype: jnp.dtype,
    bias: jax.Array | None = None,
    dot_general: DotGeneral = jax.lax.dot_general,
) -> jax.Array:
  """x [..., *in] x kernel [*in, *out] (+ bias [*out]) -> [..., *out], computed in `dtype`."""
  if x.shape[x.ndim - in_ndim :] != kernel.shape[:in_ndim]:
    raise ValueError(
        f"dense_general: input trailing shape {x.shape[x.ndim - in_ndim:]} does not match "
        f"kernel leading shape {kernel.shape[:in_ndim]}"
    )
  x, kernel, bias = promote_dtype((x, kernel, bias), dtype=dtype)
  contract = (tuple(range(x.ndim - in_ndim, x.ndim)), tuple(range(in_ndim)))
  # precision by keyword, as flax's Dense passes it: AQT's dot_general requires the argument.
  y = dot_general(x, kernel, (contract, ((), ())), precision=None)
  return y if bias is None else y + bias
