"""Projections: contract the trailing axes of x with the leading axes of a kernel."""
import jax
import jax.numpy as jnp


def dense_general(x: jax.Array, kernel: jax.Array, *, in_ndim: int, dtype: jnp.dtype) -> jax.Array:
  """x [..., *in] x kernel [*in, *out] -> [..., *out], computed in `dtype`."""
  if x.shape[x.ndim - in_ndim :] != kernel.shape[:in_ndim]:
    raise ValueError(
        f"dense_general: input trailing shape {x.shape[x.ndim - in_ndim:]} does not match "
        f"kernel leading shape {kernel.shape[:in_ndim]}"
    )
  return jnp.tensordot(x.astype(dtype), kernel.astype(dtype), axes=in_ndim)
