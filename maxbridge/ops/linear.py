"""Projections: contract the trailing axes of x with the leading axes of a kernel."""

import jax
import jax.numpy as jnp


def dense_general(
    x: jax.Array,
    kernel: jax.Array,
    *,
    in_ndim: int,
    dtype: jnp.dtype,
    bias: jax.Array | None = None,
) -> jax.Array:
  """x [..., *in] x kernel [*in, *out] (+ bias [*out]) -> [..., *out], computed in `dtype`."""
  if x.shape[x.ndim - in_ndim :] != kernel.shape[:in_ndim]:
    raise ValueError(
        f"dense_general: input trailing shape {x.shape[x.ndim - in_ndim:]} does not match "
        f"kernel leading shape {kernel.shape[:in_ndim]}"
    )
  y = jnp.tensordot(x.astype(dtype), kernel.astype(dtype), axes=in_ndim)
  return y if bias is None else y + bias.astype(dtype)
