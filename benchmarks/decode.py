"""Decoding throughput: the KV-cache engine (NNX vs Linen), the full-recompute loop, and Hugging Face eager generate.

    .venv/bin/python benchmarks/decode.py [--preset llama-small] [--batch 1 8] [--prompt 128] [--new 128]
                                          [--skip-recompute] [--skip-hf] [--rounds 5] [--per-step]
                                          [--speculative K [--train-steps N]] [--context L ...]

One process, one set of weights (`--preset`, random init; any family `export-hf` writes). The engine
prefills the prompts side by side in one batched call (`prefill_batch`), as
Hugging Face prefills its batch, inserts each into a slot, then generates
`new - 1` steps for all slots at once in one compiled loop (`generate_steps`). Hugging Face:
the same weights exported with `export-hf`, `transformers` eager `generate`
with its KV cache on torch CPU, torch's intra-op threads set to the cores JAX's
CPU client uses (all of this process's). The two engines and Hugging Face run
interleaved (`bench.interleaved`: every round runs each once, in a fresh random
order), and each ratio is the median of per-round ratios (`bench.median_ratio`),
so load on a shared machine lands on all alike. Hugging Face's prefill is timed
as `generate(max_new_tokens=1)` in the same rounds, its decode as the rest.
The engine's prefill runs five times a round
(`PREFILL_REPEATS`, their median counts), the decode once.
The recompute loop (the pre-engine `Model.generate`) is timed once, after.
Targets: NNX/Linen >= 0.98; engine >= 2x Hugging Face.
`--context L ...` instead times decode per token against the context length (`context_length`).
"""

import argparse
import contextlib
import functools
import os
import re
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import maxbridge as mb
from maxbridge.training import bench
from maxbridge.serving import engine
from maxbridge.interop import hf
from maxbridge.models import model as model_lib
from maxbridge.ops import kv_cache

BACKENDS = {"linen": (False, False, False), "nnx": (True, True, True)}
PREFILL_REPEATS = 5


def filled(eng: engine.Engine, prompts: np.ndarray) -> engine.DecodeState:
  """A decode state whose slot i holds prompts[i] (prefilled side by side), computed: nothing left in flight."""
  state = eng.init_decode_state()
  for slot, prefix in enumerate(eng.prefill_batch(prompts)):
    state = eng.insert(prefix, state, slot)
  return jax.block_until_ready(state)


def time_engine(eng: engine.Engine, prompts: np.ndarray, new: int) -> tuple[float, float, np.ndarray]:
  """(prefill seconds, decode seconds, the generated tokens [B, new]).

  The prefill (and inserts) runs PREFILL_REPEATS times and counts its median: one batch-1 prefill is a
  single ~25 ms call, whose time swung 25-44 ms with what the cores did just before.
  """
  prefill_times = []
  for _ in range(PREFILL_REPEATS):
    start = time.perf_counter()
    state = filled(eng, prompts)
    prefill_times.append(time.perf_counter() - start)
  prefill_s = statistics.median(prefill_times)
  # To host at once: generate_steps donates the state this buffer belongs to.
  first = np.asarray(state.tokens)
  start = time.perf_counter()
  state, tokens = eng.generate_steps(state, new - 1)
  tokens = np.asarray(tokens)
  decode_s = time.perf_counter() - start
  return prefill_s, decode_s, np.concatenate([first[:, None], tokens], axis=1)[: len(prompts)]


# MaxEngine 0.2.5, llama-small dims, float32, batch 1, prompt 128, 128 new tokens, per-step `generate`, on
# this project's 2-core CPU machine (issue 32): what the per-step path must at least match. Only these dims
# get the comparison column.
MAXENGINE_BATCH1_TOK_S = (171, 181)
MAXENGINE_DIMS = ("llama-small", 1, 128, 128)  # preset, batch, prompt, new tokens


@contextlib.contextmanager
def _write_first():
  """Attention layers traced inside write their cache before attention reads it (`kv_cache.update`, as
  Gemma 4's still do), the order before `kv_cache.read_first`: --write-first's baseline. XLA merges the
  two `update`s this makes of each layer's cache (the same instructions), so the program is the old one."""
  read_first, write = kv_cache.read_first, kv_cache.write

  def update_read(cache, new, positions, segment_ids, *, ring=False):
    _, values, keywords = kv_cache.update(cache, new, positions, segment_ids, ring=ring)
    return tuple((value,) for value in values), keywords

  def update_write(cache, new, positions, segment_ids, *, ring=False, after):
    return kv_cache.update(cache, new, positions, segment_ids, ring=ring)[0]

  kv_cache.read_first, kv_cache.write = update_read, update_write
  try:
    yield
  finally:
    kv_cache.read_first, kv_cache.write = read_first, write


def _cache_copies(eng: engine.Engine) -> int:
  """Whole copies of a layer's cached entry (the size of one) in the compiled decode step (copy or transpose)."""
  state = eng.init_decode_state()
  leaves = jax.tree_util.tree_leaves_with_path(state.cache)
  sizes = {leaf.size for path, leaf in leaves if "cached_" in jax.tree_util.keystr(path)}
  text = eng._generate.lower(eng._params(None), state, jax.random.key(0)).compile().as_text()
  found = re.findall(r"= \w+\[([\d,]+)\]\S* (?:transpose|copy)\(", text)
  return sum(int(np.prod([int(d) for d in dims.split(",")])) in sizes for dims in found)


def per_step(preset: str, batches: list[int], prompt: int, new: int, rounds: int, write_first: bool = False) -> None:
  """--per-step: `generate` called once per token, as a server calls it, against the compiled loop.

  Three ways per batch, interleaved: "per-step" (one `generate` call a token,
  nothing read back: how MaxEngine's figures were taken), "per-step, read" (each
  step's tokens read on the host one step late, as `maxbridge serve`'s loop
  does, so the read overlaps the next step), and "loop" (`generate_steps`).
  A step and the loop's body compile to the same kernels (dots, fusions and
  copies, give or take the loop's bookkeeping), so "vs loop" (loop time / this
  way's, > 1 faster) is what one call a token costs. "host ms" is the CPU time
  the calling thread spends per token (`time.thread_time`), mostly in jaxlib's
  dispatch; on a machine with few cores it takes time from XLA's compute
  threads. Beside batch 1 at MaxEngine's dims: MaxEngine's figures and the
  ratio of ours to them (taken on another day; `benchmarks/maxengine.py` times
  MaxEngine itself beside ours).

  `write_first` adds "write first": per-step on a second engine whose layers
  write their cache before attention reads it (`_write_first`), the order
  that made XLA copy every layer's cache on every step at batch 1, and each
  engine's count of such copies in its compiled step.
  """
  threads = len(os.sched_getaffinity(0))
  print(
      f"per-step decode, {preset}, prompt {prompt}, {new} new tokens, {jax.device_count()} {jax.default_backend()} "
      f"device(s), {threads} cores, load {os.getloadavg()[0]:.1f}; median of {rounds} interleaved rounds"
  )
  low, high = MAXENGINE_BATCH1_TOK_S
  print(f"{'batch':>5} {'what':>16} {'tok/s':>8}  {'vs loop':>7}  {'host ms':>7}  MaxEngine 0.2.5 per-step (issue 32)")
  for batch in batches:
    config = mb.load_config(
        preset, max_prefill_predict_length=prompt, max_target_length=prompt + new, per_device_batch_size=batch
    )
    eng = engine.Engine(config, mb.create_model(config, seed=0).params())
    prompts = np.asarray(jax.random.randint(jax.random.key(batch), (batch, prompt), 0, config.vocab_size), np.int32)

    host = {}  # name: [this thread's CPU seconds per round]

    def timed(decode, name, eng=eng, order=contextlib.nullcontext):
      def timer():
        with order():  # where the first round traces
          state = filled(eng, prompts)
          start, cpu = time.perf_counter(), time.thread_time()
          decode(eng, state)
          host.setdefault(name, []).append(time.thread_time() - cpu)
          return time.perf_counter() - start

      return timer

    def steps(eng, state):
      for _ in range(new):
        state, tokens = eng.generate(state)
      np.asarray(tokens)

    def steps_read(eng, state):
      last = None
      for _ in range(new):
        state, tokens = eng.generate(state)
        tokens.copy_to_host_async()
        if last is not None:
          np.asarray(last)
        last = tokens
      np.asarray(last)

    def loop(eng, state):
      np.asarray(eng.generate_steps(state, new)[1])

    ways = {"per-step": steps, "per-step, read": steps_read, "loop": loop}
    timers = {name: timed(way, name) for name, way in ways.items()}
    if write_first:
      old = engine.Engine(config, eng.model.params())
      with _write_first():
        copies = _cache_copies(old)
      print(f"{batch:>5} whole-cache copies in the compiled step: {copies} write first, {_cache_copies(eng)} now")
      ways["write first"] = steps
      timers["write first"] = timed(steps, "write first", old, _write_first)
    times = bench.interleaved(timers, rounds, warmup=1)
    compared = (preset, batch, prompt, new) == MAXENGINE_DIMS
    for name in ways:
      rate = batch * new / statistics.median(times[name])
      maxengine = f"{low}-{high} tok/s: ours {rate / high:.2f}-{rate / low:.2f}x" if compared else ""
      ratio = bench.median_ratio(times["loop"], times[name])
      host_ms = statistics.median(host[name][-rounds:]) / new * 1e3  # the timed rounds, not the warm-up (tracing)
      print(f"{batch:>5} {name:>16} {rate:8.1f}  {ratio:6.3f}x  {host_ms:7.3f}  {maxengine}".rstrip())
    if write_first:
      ratio = bench.median_ratio(times["per-step"], times["write first"])
      print(f"{batch:>5} per-step time now / write first: {ratio:.3f} (median of per-round ratios)")
  if not any((preset, batch, prompt, new) == MAXENGINE_DIMS for batch in batches):
    print(f"MaxEngine 0.2.5 (issue 32): {low}-{high} tok/s per-step, at (preset, batch, prompt, new) = {MAXENGINE_DIMS}")


def context_length(preset: str, contexts: list[int], batch: int, new: int, rounds: int) -> None:
  """--context: decode time per token with each slot's cache filled to L tokens, for each L, Linen and NNX.

  Each L gets engines whose cache holds L + `new` tokens (a decode step reads a slot's whole cache, so the
  cache's length is what a step's attention costs), prefilled once with L-token prompts. A timed call
  inserts the prefixes into fresh slots (untimed) and runs `new` steps in one `generate_steps`. Every
  (L, backend) runs once a round, in a fresh random order. A layer with a fixed-size state (DeltaNet's
  recurrence, a sliding window's or an attention chunk's ring) costs the same at every L; a global
  attention layer's cost grows linearly with L. "vs shortest": each row's Linen time over the first row's.
  """
  threads = len(os.sched_getaffinity(0))
  print(
      f"decode time per token vs context, {preset}, batch {batch}, {new} steps a call, {jax.device_count()} "
      f"{jax.default_backend()} device(s), {threads} cores, load {os.getloadavg()[0]:.1f}; "
      f"median of {rounds} interleaved rounds"
  )
  timers = {}
  for context in contexts:
    base = mb.load_config(
        preset, max_prefill_predict_length=context, max_target_length=context + new, per_device_batch_size=batch
    )
    params = mb.create_model(base, seed=0).params()
    prompts = np.asarray(jax.random.randint(jax.random.key(context), (batch, context), 0, base.vocab_size), np.int32)
    for name, flags in BACKENDS.items():
      eng = engine.Engine(base.replace(**dict(zip(("pure_nnx", "enable_nnx", "pure_nnx_decoder"), flags))), params)
      prefixes = eng.prefill_batch(prompts)

      def timer(eng=eng, prefixes=prefixes):
        state = eng.init_decode_state()
        for slot, prefix in enumerate(prefixes):
          state = eng.insert(prefix, state, slot)
        jax.block_until_ready(state)
        start = time.perf_counter()
        np.asarray(eng.generate_steps(state, new)[1])
        return time.perf_counter() - start

      timers[context, name] = timer
  times = bench.interleaved(timers, rounds, warmup=1)
  print(f"{'context':>8} {'Linen ms/token':>15} {'NNX ms/token':>13} {'NNX/Linen speed':>16} {'vs shortest':>12}")
  shortest = statistics.median(times[contexts[0], "linen"])
  for context in contexts:
    linen, nnx = times[context, "linen"], times[context, "nnx"]
    print(
        f"{context:>8} {statistics.median(linen) / new * 1e3:>15.3f} {statistics.median(nnx) / new * 1e3:>13.3f}"
        f" {bench.median_ratio(linen, nnx):>16.3f} {statistics.median(linen) / shortest:>11.2f}x"
    )


def speculative_decode(preset: str, prompt: int, new: int, rounds: int, num_draft: int, train_steps: int) -> None:
  """--speculative K: self-speculative greedy decoding (K tokens drafted by the MTP modules a step) against plain
  greedy on the engine, batch 1, interleaved rounds. With --train-steps N the model (mtp_num_layers = K) first
  trains N steps on the embedded data, so that its MTP modules draft something, and the prompts are its text."""
  from maxbridge.serving import speculative  # pylint: disable=import-outside-toplevel
  from maxbridge.training import data  # pylint: disable=import-outside-toplevel

  with tempfile.TemporaryDirectory() as run:
    config = mb.load_config(
        preset,
        mtp_num_layers=num_draft,
        max_prefill_predict_length=prompt,
        max_target_length=max(prompt + new, 64),
        per_device_batch_size=1,
        steps=max(train_steps, 1),
        base_output_directory=run,
        run_name="mtp",
    )
    if train_steps:
      losses = mb.train(config, progress=False)
      print(
          f"trained {train_steps} steps: loss {losses[0]['loss']:.3f} -> {losses[-1]['loss']:.3f}, "
          f"mtp_loss {losses[0]['mtp_loss']:.3f} -> {losses[-1]['mtp_loss']:.3f}"
      )
      model = mb.from_pretrained(f"{run}/mtp", scan_layers=False)
    else:
      model = mb.create_model(config.replace(scan_layers=False), seed=0)
  batch = np.asarray(data.make_dataset(config, "train", 1).batch(0)["inputs"])
  prompts = batch[:, :prompt]
  plain = model.config.replace(speculative_mtp_tokens=0)
  speculator = speculative.Speculator(model.config, model, num_draft)
  outputs, stats = {}, []

  eng = engine.Engine(plain, model=model)

  def plain_timer():  # generate_continuation's steps, on one engine: compiled once
    start = time.perf_counter()
    state = eng.insert(eng.prefill(prompts[0]), eng.init_decode_state(), 0)
    first = np.asarray(state.tokens[:1])
    _, rest = eng.generate_steps(state, new - 1)
    outputs["plain"] = np.concatenate([first, np.asarray(rest[0])])
    return time.perf_counter() - start

  def speculative_timer():
    start = time.perf_counter()
    outputs["speculative"], run_stats = speculator.generate(prompts[0], new)
    stats.append(run_stats)
    return time.perf_counter() - start

  times = bench.interleaved({"plain": plain_timer, "speculative": speculative_timer}, rounds, warmup=1)
  np.testing.assert_array_equal(outputs["speculative"], outputs["plain"])  # greedy's tokens, token for token
  last = stats[-1]
  print(f"speculative decoding, {preset}, mtp_num_layers={num_draft}, prompt {prompt}, {new} new tokens, batch 1")
  print(
      f"  accepted drafts {last.acceptance_rate:.1%} ({last.accepted}/{last.drafted}), "
      f"{last.tokens_per_step:.2f} tokens per verify forward ({last.steps} forwards)"
  )
  for name in ("plain", "speculative"):
    print(f"  {name:>12}: {new / statistics.median(times[name]):8.1f} tok/s (prefill included)")
  print(f"  speed-up {bench.median_ratio(times['plain'], times['speculative']):.2f}x (median of per-round ratios)")


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="llama-small")
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--skip-recompute", action="store_true")
  parser.add_argument("--skip-hf", action="store_true")
  parser.add_argument("--rounds", type=int, default=5, help="interleaved timed rounds; medians count")
  parser.add_argument("--per-step", action="store_true", help="only per-step `generate` against the compiled loop")
  parser.add_argument("--write-first", action="store_true", help="--per-step: also the cache written before it is read")
  parser.add_argument("--speculative", type=int, default=0, metavar="K", help="only MTP self-speculative decoding")
  parser.add_argument("--train-steps", type=int, default=0, help="--speculative: train the MTP model first")
  parser.add_argument(
      "--context", type=int, nargs="+", metavar="L", help="only decode time per token at these context lengths"
  )
  args = parser.parse_args()
  if args.context:
    if min(args.context) < 1 or len(args.batch) != 1:
      parser.error(f"--context lengths must be >= 1 and --batch one size, got {args.context} and {args.batch}")
    context_length(args.preset, sorted(args.context), args.batch[0], args.new, args.rounds)
    return
  if args.speculative:
    speculative_decode(args.preset, args.prompt, args.new, args.rounds, args.speculative, args.train_steps)
    return
  if args.per_step:
    per_step(args.preset, args.batch, args.prompt, args.new, args.rounds, args.write_first)
    return

  threads = len(os.sched_getaffinity(0))  # XLA's CPU client runs one intra-op thread per core it may use
  print(
      f"{args.preset}, prompt {args.prompt}, {args.new} new tokens, {jax.device_count()} {jax.default_backend()} "
      f"device(s), {threads} cores, load {os.getloadavg()[0]:.1f}; median of {args.rounds} interleaved rounds"
  )
  print(f"{'batch':>5} {'what':>22} {'prefill tok/s':>14} {'decode tok/s':>13} {'end-to-end tok/s':>17}  ratios")
  for batch in args.batch:
    overrides = dict(
        max_prefill_predict_length=args.prompt, max_target_length=args.prompt + args.new, per_device_batch_size=batch
    )
    base = mb.load_config(args.preset, **overrides)
    params = mb.create_model(base, seed=0).params()
    prompts = np.asarray(jax.random.randint(jax.random.key(batch), (batch, args.prompt), 0, base.vocab_size), np.int32)
    engines = {
        name: engine.Engine(base.replace(**dict(zip(("pure_nnx", "enable_nnx", "pure_nnx_decoder"), flags))), params)
        for name, flags in BACKENDS.items()
    }
    parts, outputs, timers = {}, {}, {}

    def engine_timer(name):
      def timer():
        prefill_s, decode_s, outputs[name] = time_engine(engines[name], prompts, args.new)
        parts.setdefault(name, []).append((prefill_s, decode_s))
        return prefill_s + decode_s

      return timer

    for name in BACKENDS:
      timers[name] = engine_timer(name)
    if not args.skip_hf:
      import torch  # pylint: disable=import-outside-toplevel
      import transformers  # pylint: disable=import-outside-toplevel

      torch.set_num_threads(threads)
      with tempfile.TemporaryDirectory() as folder:
        hf.save_hf(params, base, f"{folder}/model")
        torch_model = transformers.AutoModelForCausalLM.from_pretrained(f"{folder}/model", dtype=torch.float32)
      torch_model.eval()
      ids = torch.tensor(prompts, dtype=torch.long)

      def hf_timer(new):
        def timer():
          kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, use_cache=True)
          start = time.perf_counter()
          with torch.no_grad():
            outputs["hf" if new > 1 else "hf prefill"] = torch_model.generate(ids, **kwargs)
          return time.perf_counter() - start

        return timer

      timers["hf"], timers["hf prefill"] = hf_timer(args.new), hf_timer(1)
    times = bench.interleaved(timers, args.rounds, warmup=1)
    for name in BACKENDS:
      parts[name] = parts[name][1:]  # the warm-up (compile) run
    np.testing.assert_array_equal(outputs["nnx"], outputs["linen"])

    def rates(prefill_s, decode_s, total_s):
      return (batch * args.prompt / prefill_s, batch * (args.new - 1) / decode_s, batch * args.new / total_s)

    def row(what, rate, ratios):
      cells = [(f"{r:{w}.{d}f}" if r is not None else " " * w) for r, w, d in zip(rate, (14, 13, 17), (0, 1, 1))]
      print(f"{batch:>5} {what:>22} {' '.join(cells)}  {ratios}")

    medians = {name: [statistics.median(p[i] for p in parts[name]) for i in (0, 1)] for name in BACKENDS}
    for name in BACKENDS:
      prefill, decode = (bench.median_ratio([p[i] for p in parts["linen"]], [p[i] for p in parts[name]]) for i in (0, 1))
      row(
          f"engine {name}",
          rates(*medians[name], statistics.median(times[name])),
          f"{prefill:.3f}x prefill, {decode:.3f}x decode of linen",
      )
    if not args.skip_hf:
      hf_decode = [total - prefill for total, prefill in zip(times["hf"], times["hf prefill"])]
      same = np.mean(outputs["hf"][:, args.prompt :].numpy() == outputs["linen"])
      for name in BACKENDS:
        engine_decode = [p[1] for p in parts[name]]
        print(
            f"{'':>5} {'engine ' + name + ' / HF':>22} end-to-end {bench.median_ratio(times['hf'], times[name]):.2f}x, "
            f"decode {bench.median_ratio(hf_decode, engine_decode):.2f}x"
        )
      row(
          "HF eager (torch CPU)",
          rates(statistics.median(times["hf prefill"]), statistics.median(hf_decode), statistics.median(times["hf"])),
          f"{same:.0%} tokens equal to the engine's; torch threads {torch.get_num_threads()}",
      )
    if not args.skip_recompute:
      model, unrolled = engines["linen"].model, engines["linen"].params  # as the engine runs them
      run = jax.jit(
          functools.partial(model_lib.generate_by_recompute, model.apply), static_argnames=("max_new_tokens", "sample")
      )
      call = lambda: run(
          unrolled, jnp.asarray(prompts), jnp.float32(0), jax.random.key(0), max_new_tokens=args.new, sample=False
      )
      jax.block_until_ready(call())
      start = time.perf_counter()
      jax.block_until_ready(call())
      seconds = time.perf_counter() - start
      engine_s = statistics.median(times["linen"])
      row("full recompute", (None, None, batch * args.new / seconds), f"engine linen {seconds / engine_s:.1f}x faster")


if __name__ == "__main__":
  main()
