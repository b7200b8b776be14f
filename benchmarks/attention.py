"""Attention kernels: dot_product vs flash, compiled temporary memory and time of a forward + backward, side by side.

    .venv/bin/python benchmarks/attention.py [--lengths 1024 4096] [--batch 1] [--heads 8] [--kv-heads 2]
                                             [--head-dim 64] [--rounds 3]

For each length T, both kernels of `ops.attention.KERNELS` compute the
gradient of a causal self-attention's weighted output w.r.t. query, key and
value, jitted alone. `temp` is XLA's `memory_analysis().temp_size_in_bytes`
of that program: dot_product holds [B, N, T, T] float32 scores (and their
softmax) for the backward pass; flash holds one block's, 128 x 512, and
recomputes them. Times are medians of interleaved rounds (each round runs
both kernels once), so machine noise lands on both alike.
"""

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.ops import attention

KERNELS = ("dot_product", "flash")


def gradient_step(kernel: str, length: int, args: argparse.Namespace):
  """(compiled forward + backward, its arguments) of one kernel at one length."""
  keys = jax.random.split(jax.random.key(0), 4)
  query = jax.random.normal(keys[0], (args.batch, length, args.heads, args.head_dim), jnp.float32)
  key, value = (jax.random.normal(k, (args.batch, length, args.kv_heads, args.head_dim), jnp.float32) for k in keys[1:3])
  cotangent = jax.random.normal(keys[3], query.shape, jnp.float32)
  ids = jnp.ones((args.batch, length), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), ids.shape)
  masking = dict(q_segment_ids=ids, kv_segment_ids=ids, q_positions=positions, kv_positions=positions)

  def loss(query, key, value):
    return jnp.sum(attention.KERNELS[kernel](query, key, value, **masking) * cotangent)

  inputs = (query, key, value)
  compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(*inputs).compile()
  return compiled, inputs


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
  parser.add_argument("--batch", type=int, default=1)
  parser.add_argument("--heads", type=int, default=8)
  parser.add_argument("--kv-heads", type=int, default=2)
  parser.add_argument("--head-dim", type=int, default=64)
  parser.add_argument("--rounds", type=int, default=3, help="timed rounds")
  args = parser.parse_args()

  print(
      f"causal self-attention, forward + backward, batch {args.batch}, {args.heads} heads "
      f"({args.kv_heads} kv), head_dim {args.head_dim}, float32, {jax.devices()[0].platform}"
  )
  print(
      f"{'T':>6} {'kernel':>12} {'temp MiB':>10} {'temp ratio':>10} {'s/step':>8} {'time ratio':>10} {'max |grad diff|':>15}"
  )
  for length in args.lengths:
    steps = {kernel: gradient_step(kernel, length, args) for kernel in KERNELS}
    grads = {kernel: compiled(*inputs) for kernel, (compiled, inputs) in steps.items()}  # also the warm-up
    times = {kernel: [] for kernel in KERNELS}
    for _ in range(args.rounds):
      for kernel, (compiled, inputs) in steps.items():
        start = time.perf_counter()
        jax.block_until_ready(compiled(*inputs))
        times[kernel].append(time.perf_counter() - start)
    base_temp = steps["dot_product"][0].memory_analysis().temp_size_in_bytes
    base_time = statistics.median(times["dot_product"])
    for kernel in KERNELS:
      temp = steps[kernel][0].memory_analysis().temp_size_in_bytes
      seconds = statistics.median(times[kernel])
      diff = max(float(np.max(np.abs(a - b))) for a, b in zip(grads[kernel], grads["dot_product"]))
      print(
          f"{length:>6} {kernel:>12} {temp / 2**20:>10.1f} {temp / base_temp:>10.3f} {seconds:>8.3f} "
          f"{seconds / base_time:>10.2f} {diff:>15.2e}"
      )


if __name__ == "__main__":
  main()
