"""Per-step decode beside MaxEngine: the same dimensions, one process, interleaved rounds.

MaxEngine needs Python >= 3.12 and MaxText's own requirements, so this runs from a venv of its own
(MaxText 0.2.5 declares no dependencies; its wheel ships the lists):

    python3.12 -m venv .venv-maxtext
    .venv-maxtext/bin/pip install maxtext==0.2.5
    SITE=$(.venv-maxtext/bin/python -c 'import maxtext, os; print(os.path.dirname(os.path.dirname(maxtext.__file__)))')
    .venv-maxtext/bin/pip install -r $SITE/dependencies/requirements/generated_requirements/decoupled-requirements.txt
    .venv-maxtext/bin/pip install -e .
    .venv-maxtext/bin/python benchmarks/maxengine.py [--preset llama-small] [--batch 1 8] [--prompt 128] [--new 128]
                                                     [--rounds 7]

Both engines get a model of `--preset`'s dimensions (MaxText's keys are ours, so the config is passed key
for key, and the parameter counts are checked equal), float32, greedy, random weights, unscanned layers
(MaxEngine's fast path on CPU, and the one that gives issue 32's 171-181 tok/s; scanned, it decodes ~16).
Each batch's slots are filled with the same prompts (not timed), then "MaxEngine" calls its `generate`
once per token (it splits its key on the host each call, as JetStream calls it), "ours" calls
`Engine.generate` once per token, and "ours, loop" runs `generate_steps` (one compiled loop). Every round
runs each once in a fresh random order (`bench.interleaved`); "vs MaxEngine" is the median of per-round
ratios (> 1: faster than MaxEngine). Without JetStream (it needs seqio), MaxText uses stub result types,
registered here as pytrees so that its jitted prefill can return them.
"""

import argparse
import functools
import importlib.metadata
import os
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import maxbridge as mb
from maxbridge.serving import engine
from maxbridge.training import bench
from decode import filled  # benchmarks/, the script's folder

try:
  import maxtext
  from maxtext.configs import pyconfig
  from maxtext.inference.maxengine import maxengine
except ImportError as error:
  raise SystemExit(
      f"benchmarks/maxengine.py needs MaxText 0.2.5 ({error}); see this file's docstring for its venv"
  ) from error

# The model's shape, in MaxText's names (ours are the same).
DIMS = (
    "decoder_block",
    "base_emb_dim",
    "base_num_query_heads",
    "base_num_kv_heads",
    "head_dim",
    "base_mlp_dim",
    "base_num_decoder_layers",
    "vocab_size",
    "logits_via_embedding",
    "normalization_layer_epsilon",
)


@functools.cache  # a type is registered once
def _register_stub_result_tokens() -> None:
  if not getattr(maxengine.engine_api, "_IS_STUB", False):
    return  # JetStream's own ResultTokens is a pytree
  stub, fields = maxengine.engine_api.ResultTokens, ("tokens_idx", "valid_idx", "length_idx", "samples_per_slot")
  jax.tree_util.register_pytree_node(
      stub,
      lambda r: ((r.data, r.log_prob), tuple(getattr(r, f) for f in fields)),
      lambda aux, children: stub(data=children[0], log_prob=children[1], **dict(zip(fields, aux))),
  )


def maxengine_for(config: mb.Config, batch: int) -> tuple:
  """(MaxEngine, its params) for `config`'s model."""
  _register_stub_result_tokens()
  base = os.path.join(os.path.dirname(maxtext.__file__), "configs", "base.yml")
  keys = {key: getattr(config, key) for key in DIMS}
  keys.update(
      max_prefill_predict_length=config.max_prefill_predict_length,
      max_target_length=config.max_target_length,
      per_device_batch_size=batch,
      dtype="float32",
      weight_dtype="float32",
      attention="dot_product",
      scan_layers=False,  # MaxEngine's fast path here: scanned, it ran 15.9 tok/s at batch 1 (2026-11-27)
      decode_sampling_strategy="greedy",
      enable_checkpointing=False,
      skip_jax_distributed_system=True,
      hardware="cpu",
      run_name="maxbridge-benchmark",
      base_output_directory=os.path.join(os.environ.get("TMPDIR", "/tmp"), "maxbridge-maxengine"),
  )
  argv = ["", base, *(f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in keys.items())]
  maxengine_ = maxengine.MaxEngine(pyconfig.initialize(argv))
  return maxengine_, maxengine_.load_params(rng=jax.random.PRNGKey(0))


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--preset", default="llama-small")
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--rounds", type=int, default=7)
  args = parser.parse_args()
  new = args.new
  print(
      f"per-step decode beside MaxEngine (maxtext {importlib.metadata.version('maxtext')}), {args.preset}, "
      f"prompt {args.prompt}, {new} new tokens, jax {jax.__version__}, "
      f"{len(os.sched_getaffinity(0))} cores, load {os.getloadavg()[0]:.1f}; median of {args.rounds} interleaved rounds"
  )
  print(f"{'batch':>5} {'what':>12} {'tok/s':>8}  vs MaxEngine")
  for batch in args.batch:
    config = mb.load_config(
        args.preset,
        max_prefill_predict_length=args.prompt,
        max_target_length=args.prompt + new,
        per_device_batch_size=batch,
        decode_sampling_strategy="greedy",
        scan_layers=False,
    )
    ours = engine.Engine(config, mb.create_model(config, seed=0).params())
    theirs, their_params = maxengine_for(config, batch)
    counts = [sum(x.size for x in jax.tree.leaves(p)) for p in (ours.params, their_params)]
    if counts[0] != counts[1]:
      raise SystemExit(f"parameter counts differ: ours {counts[0]:,}, MaxEngine's {counts[1]:,}")
    prompts = np.asarray(jax.random.randint(jax.random.key(batch), (batch, args.prompt), 0, config.vocab_size))

    def their_state():
      state = theirs.init_decode_state()
      for slot, row in enumerate(prompts):
        prefix, _ = theirs.prefill(params=their_params, padded_tokens=jnp.asarray(row), true_length=args.prompt)
        state = theirs.insert(prefix, state, slot)
      return jax.block_until_ready(state)

    def timed(fill, decode):
      def timer():
        state = fill()
        start = time.perf_counter()
        decode(state)
        return time.perf_counter() - start

      return timer

    def their_steps(state):
      for _ in range(new):
        state, result = theirs.generate(their_params, state)
      jax.block_until_ready(result.data)

    def our_steps(state):
      for _ in range(new):
        state, tokens = ours.generate(state)
      np.asarray(tokens)

    def our_loop(state):
      np.asarray(ours.generate_steps(state, new)[1])

    timers = {
        "MaxEngine": timed(their_state, their_steps),
        "ours": timed(functools.partial(filled, ours, prompts), our_steps),
        "ours, loop": timed(functools.partial(filled, ours, prompts), our_loop),
    }
    times = bench.interleaved(timers, args.rounds, warmup=1)
    for name in timers:
      rate = batch * new / statistics.median(times[name])
      print(f"{batch:>5} {name:>12} {rate:8.1f}  {bench.median_ratio(times['MaxEngine'], times[name]):.3f}x")


if __name__ == "__main__":
  main()
