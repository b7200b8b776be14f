"""RMSNorm as in MaxText/Llama: x * rsqrt(mean(x^2) + eps) * scale."""
import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, scale: jax.Array, *, epsilon: float, dtype: jnp.dtype) -> jax.Array:
  with jax.named_scope("rms_norm"):
    # Statistics in float32 even for bfloat16 activations: the mean of squares
    # loses most of its bits otherwise.
    x32 = x.astype(jnp.float32)
    mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    y = (x32 * jax.lax.rsqrt(mean_square + epsilon)).astype(dtype)
    return y * scale.astype(dtype)
