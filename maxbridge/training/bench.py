"""Train-step time of the flag combinations, side by side in one process, as ratios to pure Linen.

`maxbridge bench <preset> [key=value ...]` and `benchmarks/step_time.py` run
`step_time`. A combination is named state/model/decoder, i.e.
pure_nnx/enable_nnx/pure_nnx_decoder: "linen/linen/linen" is pure Linen,
"nnx/nnx/nnx" pure NNX.

Timing is interleaved: each round times one step of every combination in turn,
in a random order drawn afresh each round, so machine noise (other processes,
frequency changes), position and neighbours in the round land on all alike.
The ratio column is the median of the per-round ratios to pure Linen, which
cancels noise that a ratio of medians would keep.

FLOPs per step are `aot.model_flops`. XLA's own count (cost_analysis) is
printed as a cross-check; it counts a scan body once, so it undercounts
scanned steps by about L times.
"""

import itertools
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.training import aot, data
from maxbridge.models import dispatch
from maxbridge.core.config import Config, load_config
from maxbridge.training.loop import global_batch_size
from maxbridge.training import recipe

# (pure_nnx, enable_nnx, pure_nnx_decoder)
ALL_COMBOS = list(itertools.product([False, True], repeat=3))
PURE_LINEN, PURE_NNX = (False, False, False), (True, True, True)
# The pure ends, and one flip from each: an NNX decoder bridged into Linen and
# a Linen decoder bridged into NNX, where the bridges do the most work.
MINIMAL_COMBOS = [PURE_LINEN, PURE_NNX, (False, False, True), (True, True, False)]
COMBOS = {"all": ALL_COMBOS, "minimal": MINIMAL_COMBOS}
SCANS = {"both": (True, False), "true": (True,), "false": (False,)}
# 15, not 20, timed rounds by default: all 8 combinations x 2 scan settings
# then take about 10 minutes on 2 CPU cores.
DEFAULT_STEPS = 15
DEFAULT_WARMUP = 3


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


def timed_step(trainer, state, batch):
  # Blocking on the loss is enough on CPU: an executable's outputs all become ready together.
  start = time.perf_counter()
  state, metrics = trainer.train_step(state, batch)
  metrics["loss"].block_until_ready()
  return state, time.perf_counter() - start


def start(config: Config, batch):
  """(trainer, state after one step, seconds of that first call: trace + compile + one step)."""
  trainer = recipe.create_trainer(config)
  state, seconds = timed_step(trainer, trainer.init_state(config.seed), batch)
  return trainer, state, seconds


def interleaved(timers: dict, rounds: int, warmup: int = 0) -> dict:
  """{key: [seconds per round]} for `timers` ({key: a no-argument callable returning seconds}).

  After `warmup` untimed calls each, every round calls every timer once, in a
  fresh random order (seeded), so machine noise lands on all alike.
  """
  for timer in timers.values():
    for _ in range(warmup):
      timer()
  keys = list(timers)
  times = {key: [] for key in keys}
  order_rng = np.random.default_rng(0)
  for _ in range(rounds):
    for index in order_rng.permutation(len(keys)):
      times[keys[index]].append(timers[keys[index]]())
  return times


def median_ratio(times: list[float], base: list[float]) -> float:
  """The median of per-round ratios `times / base`: it cancels noise that a ratio of medians would keep."""
  return statistics.median(t / b for t, b in zip(times, base))


def _first_batch(config: Config):
  return data.make_dataset(config, "train", global_batch_size(config)).batch(0)


def _scan_setting(configs: dict, combos: list, steps: int, warmup: int, matmul_seconds, matmul_flops: int) -> None:
  cfg = configs[PURE_LINEN]
  rows = global_batch_size(cfg)
  dataset = data.make_dataset(cfg, "train", rows)
  # One batch list for every combination: the same data, the same work.
  batches = [dataset.batch(step) for step in range(1 + warmup + steps)]
  trainers, states, compile_s = {}, {}, {}
  for flags in combos:  # one at a time, so each compile time is measured alone
    trainers[flags], states[flags], compile_s[flags] = start(configs[flags], batches[0])
  for batch in batches[1 : 1 + warmup]:
    for flags in combos:
      states[flags], _ = timed_step(trainers[flags], states[flags], batch)

  # Each round times every combination and the matmul (None) once, in a fresh
  # random order: a fixed or rotated order would keep the same neighbour before
  # each entry (the matmul's busy thread pool, say), a bias noise cannot cancel.
  times = {flags: [] for flags in combos}
  matmul_times = []
  entries = combos + [None]
  order_rng = np.random.default_rng(0)
  for batch in batches[1 + warmup :]:
    for index in order_rng.permutation(len(entries)):
      flags = entries[index]
      if flags is None:
        matmul_times.append(matmul_seconds())
      else:
        states[flags], seconds = timed_step(trainers[flags], states[flags], batch)
        times[flags].append(seconds)
  peak = matmul_flops / statistics.median(matmul_times)

  num_params = sum(x.size for x in jax.tree.leaves(trainers[PURE_LINEN].abstract_params))
  tokens = rows * cfg.max_target_length
  flops = aot.model_flops(cfg, num_params, tokens)
  # After the timed runs, so that its compile cannot warm anything the first calls then skip.
  xla_flops = aot.compile_train_step(cfg)["flops"]

  print(
      f"\n== scan_layers={cfg.scan_layers}: {cfg.model_name}, {num_params:,} params, batch {rows} x "
      f"length {cfg.max_target_length} = {tokens} tokens, {steps} timed rounds after {warmup} warm-up =="
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


def step_time(
    preset: str,
    *overrides: str,
    steps: int = DEFAULT_STEPS,
    warmup: int = DEFAULT_WARMUP,
    combos: str = "all",
    scan: str = "both",
) -> None:
  """Prints, per scan setting, each combination's step and compile time as ratios to pure Linen.

  `overrides` (key=value) apply to every combination; the flags and
  `scan_layers` are the benchmark's. combos: "all" 8 or "minimal" 4; scan:
  "both", "true" or "false".
  """
  if steps < 1 or warmup < 0:
    raise ValueError(f"steps must be >= 1 and warmup >= 0, got steps={steps}, warmup={warmup}")
  if combos not in COMBOS or scan not in SCANS:
    raise ValueError(f"combos must be one of {sorted(COMBOS)} and scan one of {sorted(SCANS)}")
  chosen = COMBOS[combos]
  # Every config is read now: a YAML file edited during a long run cannot change it halfway.
  configs = {
      scan_layers: {
          flags: load_config(
              preset, *overrides, **dispatch.backend_flags(flags), scan_layers=scan_layers, dataset_type="synthetic"
          )
          for flags in chosen
      }
      for scan_layers in SCANS[scan]
  }
  matmul_seconds, matmul_flops = matmul_timer()
  print(
      f"jax {jax.__version__} on {jax.devices()[0].platform}, {jax.device_count()} device(s). "
      f"Combination = state/model/decoder (pure_nnx/enable_nnx/pure_nnx_decoder); step 'vs Linen' "
      f"= median of per-round ratios; compile = first call (trace + compile + one step)."
  )
  if steps == DEFAULT_STEPS:
    print(f"steps default to {DEFAULT_STEPS} (not 20) to keep a full run near 10 minutes on 2 CPU cores.")
  # The first compile in a process also pays one-time setup; a throwaway one
  # keeps that out of pure Linen's compile time, the base of the ratios.
  first = next(iter(configs.values()))[PURE_LINEN]
  start(first, _first_batch(first))
  for by_flags in configs.values():
    _scan_setting(by_flags, chosen, steps, warmup, matmul_seconds, matmul_flops)
