"""Train-step time of the flag combinations, side by side in one process, as ratios to pure Linen.

    .venv/bin/python benchmarks/step_time.py [--steps 15] [--combos all|minimal] [--scan both|true|false]

A combination is named state/model/decoder, i.e. pure_nnx/enable_nnx/pure_nnx_decoder:
"linen/linen/linen" is pure Linen, "nnx/nnx/nnx" pure NNX.

Timing is interleaved: each round times one step of every combination in turn,
in a random order drawn afresh each round, so machine noise (other processes,
frequency changes), position and neighbours in the round land on all alike.
The ratio column is the median of the per-round ratios to pure Linen, which
cancels noise that a ratio of medians would keep.

FLOPs per step are the standard estimate 6*N*tokens + 12*L*T*H*tokens
(N all parameters, L layers, T sequence length, H query heads * head dim):
forward and backward matmuls of the weights, plus the attention scores and
their weighted sum over the full T x T (no causal skipping is compiled).
XLA's own count (cost_analysis) is printed as a cross-check; it counts a scan
body once, so it undercounts scanned steps by about L times.
"""

import argparse
import itertools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import maxbridge as mb
from maxbridge import aot, data, dispatch

# (pure_nnx, enable_nnx, pure_nnx_decoder)
ALL_COMBOS = list(itertools.product([False, True], repeat=3))
PURE_LINEN, PURE_NNX = (False, False, False), (True, True, True)
# The pure ends, and one flip from each: an NNX decoder bridged into Linen and
# a Linen decoder bridged into NNX, where the bridges do the most work.
MINIMAL_COMBOS = [PURE_LINEN, PURE_NNX, (False, False, True), (True, True, False)]
# 15, not 20, timed rounds by default: all 8 combinations x 2 scan settings
# then take about 10 minutes on 2 CPU cores.
DEFAULT_STEPS = 15


def combo_name(flags) -> str:
  return "/".join("nnx" if flag else "linen" for flag in flags)


def matmul_timer(n: int = 2048):
  """A function timing one jitted float32 n x n matmul: the ceiling a train step can reach here."""
  a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
  b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
  dot = jax.jit(jnp.dot)
  for _ in range(3):
    dot(a, b).block_until_ready()

  def seconds() -> float:
    start = time.perf_counter()
    dot(a, b).block_until_ready()
    return time.perf_counter() - start

  return seconds, 2 * n**3


def step_flops(cfg: mb.Config, num_params: int, tokens: int) -> float:
  attention_width = cfg.num_query_heads * cfg.head_dim
  attention = 12 * cfg.num_decoder_layers * cfg.max_target_length * attention_width
  return (6 * num_params + attention) * tokens


def timed_step(trainer, state, batch):
  # Blocking on the loss is enough on CPU: an executable's outputs all become ready together.
  start = time.perf_counter()
  state, metrics = trainer.train_step(state, batch)
  metrics["loss"].block_until_ready()
  return state, time.perf_counter() - start


def config_for(args, flags, scan: bool) -> mb.Config:
  pure_nnx, enable_nnx, pure_nnx_decoder = flags
  return mb.load_config(
      args.preset,
      pure_nnx=pure_nnx,
      enable_nnx=enable_nnx,
      pure_nnx_decoder=pure_nnx_decoder,
      scan_layers=scan,
      per_device_batch_size=args.batch,
      max_target_length=args.length,
      dataset_type="synthetic",
  )


def start(cfg: mb.Config, batch):
  """(trainer, state after one step, seconds of that first call: trace + compile + one step)."""
  trainer = dispatch.create_trainer(cfg)
  state, seconds = timed_step(trainer, trainer.init_state(cfg.seed), batch)
  return trainer, state, seconds


def bench_scan_setting(args, configs: dict, combos: list, matmul_seconds, matmul_flops: int) -> None:
  cfg = configs[PURE_LINEN]
  dataset = data.make_dataset(cfg, "train", global_batch_size=args.batch)
  # One batch list for every combination: the same data, the same work.
  batches = [dataset.batch(step) for step in range(1 + args.warmup + args.steps)]
  trainers, states, compile_s = {}, {}, {}
  for flags in combos:  # one at a time, so each compile time is measured alone
    trainers[flags], states[flags], compile_s[flags] = start(configs[flags], batches[0])
  for batch in batches[1 : 1 + args.warmup]:
    for flags in combos:
      states[flags], _ = timed_step(trainers[flags], states[flags], batch)

  # Each round times every combination and the matmul (None) once, in a fresh
  # random order: a fixed or rotated order would keep the same neighbour before
  # each entry (the matmul's busy thread pool, say), a bias noise cannot cancel.
  times = {flags: [] for flags in combos}
  matmul_times = []
  entries = combos + [None]
  order_rng = np.random.default_rng(0)
  for batch in batches[1 + args.warmup :]:
    for index in order_rng.permutation(len(entries)):
      flags = entries[index]
      if flags is None:
        matmul_times.append(matmul_seconds())
      else:
        states[flags], seconds = timed_step(trainers[flags], states[flags], batch)
        times[flags].append(seconds)
  peak = matmul_flops / statistics.median(matmul_times)

  linen = trainers[PURE_LINEN]
  num_params = sum(x.size for x in jax.tree.leaves(linen.abstract_params))
  tokens = args.batch * args.length
  flops = step_flops(cfg, num_params, tokens)
  # After the timed runs, so that its compile cannot warm anything the first calls then skip.
  xla_flops = aot.compile_train_step(cfg)["flops"]

  print(
      f"\n== scan_layers={cfg.scan_layers}: {args.preset}, {num_params:,} params, batch {args.batch} x "
      f"length {args.length} = {tokens} tokens, {args.steps} timed rounds after {args.warmup} warm-up =="
  )
  print(
      f"   step FLOPs (6*N*tokens + 12*L*T*H*tokens): {flops / 1e9:.1f} G "
      f"(XLA cost_analysis of pure Linen: {xla_flops / 1e9:.1f} G); "
      f"float32 matmul peak (2048^3 dot, median over rounds): {peak / 1e9:.1f} GFLOP/s"
  )
  header = (
      f"{'combination':<20}{'median ms':>10}{'vs Linen':>10}{'compile s':>11}{'vs Linen':>10}"
      f"{'GFLOP/s':>9}{'% peak':>8}"
  )
  print(header)
  print("-" * len(header))
  for flags in combos:
    median = statistics.median(times[flags])
    ratio = statistics.median(t / base for t, base in zip(times[flags], times[PURE_LINEN]))
    print(
        f"{combo_name(flags):<20}{median * 1e3:>10.1f}{ratio:>10.3f}{compile_s[flags]:>11.2f}"
        f"{compile_s[flags] / compile_s[PURE_LINEN]:>10.2f}{flops / median / 1e9:>9.1f}"
        f"{100 * flops / median / peak:>8.1f}"
    )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="llama-small")
  parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="timed rounds (one step per combination)")
  parser.add_argument("--warmup", type=int, default=3, help="untimed steps after the first call")
  parser.add_argument("--batch", type=int, default=4)
  parser.add_argument("--length", type=int, default=128)
  parser.add_argument("--combos", choices=("all", "minimal"), default="all")
  parser.add_argument("--scan", choices=("both", "true", "false"), default="both")
  args = parser.parse_args()
  if min(args.steps, args.batch, args.length) < 1 or args.warmup < 0:
    parser.error("--steps, --batch and --length must be >= 1, --warmup >= 0")

  combos = ALL_COMBOS if args.combos == "all" else MINIMAL_COMBOS
  scans = {"both": [True, False], "true": [True], "false": [False]}[args.scan]
  # Every config is read now: a YAML file edited during a long run cannot change it halfway.
  configs = {scan: {flags: config_for(args, flags, scan) for flags in combos} for scan in scans}
  matmul_seconds, matmul_flops = matmul_timer()
  print(
      f"jax {jax.__version__} on {jax.devices()[0].platform}, {jax.device_count()} device(s). "
      f"Combination = state/model/decoder (pure_nnx/enable_nnx/pure_nnx_decoder); step 'vs Linen' "
      f"= median of per-round ratios; compile = first call (trace + compile + one step)."
  )
  if args.steps == DEFAULT_STEPS:
    print(f"--steps defaults to {DEFAULT_STEPS} (not 20) to keep a full run near 10 minutes on 2 CPU cores.")
  # The first compile in a process also pays one-time setup; a throwaway one
  # keeps that out of pure Linen's compile time, the base of the ratios.
  first = configs[scans[0]][PURE_LINEN]
  start(first, data.make_dataset(first, "train", global_batch_size=args.batch).batch(0))
  for scan in scans:
    bench_scan_setting(args, configs[scan], combos, matmul_seconds, matmul_flops)


if __name__ == "__main__":
  main()
