"""Decoding throughput: the KV-cache engine (NNX vs Linen), the full-recompute loop, and Hugging Face eager generate.

    .venv/bin/python benchmarks/decode.py [--preset llama-small] [--batch 1 8] [--prompt 128] [--new 128]
                                          [--skip-recompute] [--skip-hf] [--repeats 5]

One process, one set of weights (llama-small, random init). The engine
prefills each prompt, inserts it into a slot, then generates `new - 1` steps
for all slots at once in one compiled loop (`generate_steps`); prefill and decode tokens/s are timed apart, after a
compile run, best of --repeats interleaved runs. The recompute loop is the pre-engine `Model.generate`
(`model.generate_by_recompute`). Hugging Face: the same weights exported with
`export-hf`, `transformers` eager `generate` with its KV cache on torch CPU.
Targets: NNX/Linen >= 0.98; engine >= 2x Hugging Face.
"""

import argparse
import functools
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

import maxbridge as mb
from maxbridge import engine, hf, model as model_lib

BACKENDS = {"linen": (False, False, False), "nnx": (True, True, True)}


def time_engine(eng: engine.Engine, prompts: np.ndarray, new: int) -> tuple[float, float, np.ndarray]:
  """(prefill tokens/s, decode tokens/s, the generated tokens [B, new])."""
  start = time.perf_counter()
  state = eng.init_decode_state()
  for slot, prompt in enumerate(prompts):
    state = eng.insert(eng.prefill(prompt), state, slot)
  jax.block_until_ready(state)
  prefill_s = time.perf_counter() - start
  # To host at once: generate_steps donates the state this buffer belongs to.
  first = np.asarray(state.tokens)
  start = time.perf_counter()
  state, tokens = eng.generate_steps(state, new - 1)
  tokens = np.asarray(tokens)
  decode_s = time.perf_counter() - start
  batch = len(prompts)
  out = np.concatenate([first[:, None], tokens], axis=1)[:batch]
  return batch * prompts.shape[1] / prefill_s, batch * (new - 1) / decode_s, out


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="llama-small")
  parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  parser.add_argument("--prompt", type=int, default=128)
  parser.add_argument("--new", type=int, default=128)
  parser.add_argument("--skip-recompute", action="store_true")
  parser.add_argument("--skip-hf", action="store_true")
  parser.add_argument("--repeats", type=int, default=5, help="timed runs of each; the best counts")
  args = parser.parse_args()

  print(
      f"{args.preset}, prompt {args.prompt}, {args.new} new tokens, {jax.device_count()} {jax.default_backend()} device(s)"
  )
  print(f"{'batch':>5} {'what':>22} {'prefill tok/s':>14} {'decode tok/s':>13} {'ratio (prefill / decode)':>24}")
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
    for eng in engines.values():
      time_engine(eng, prompts, args.new)  # compile
    # Interleaved and best of --repeats: on a shared machine the load moves between runs.
    rates, outputs = {name: [0.0, 0.0] for name in BACKENDS}, {}
    for _ in range(args.repeats):
      for name, eng in engines.items():
        prefill, decode, outputs[name] = time_engine(eng, prompts, args.new)
        rates[name] = [max(rates[name][0], prefill), max(rates[name][1], decode)]
    np.testing.assert_array_equal(outputs["nnx"], outputs["linen"])
    for name in BACKENDS:
      ratio = f"{rates[name][0] / rates['linen'][0]:.3f}x / {rates[name][1] / rates['linen'][1]:.3f}x linen"
      print(f"{batch:>5} {'engine ' + name:>22} {rates[name][0]:>14.0f} {rates[name][1]:>13.1f} {ratio:>24}")
    decode_rate = rates["linen"][1]
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
      rate = batch * args.new / (time.perf_counter() - start)
      print(f"{batch:>5} {'full recompute':>22} {'':>14} {rate:>13.1f} {decode_rate / rate:>10.2f}x <")
    if not args.skip_hf:
      import torch  # pylint: disable=import-outside-toplevel
      import transformers  # pylint: disable=import-outside-toplevel

      with tempfile.TemporaryDirectory() as folder:
        hf.save_hf(params, base, f"{folder}/model")
        torch_model = transformers.AutoModelForCausalLM.from_pretrained(f"{folder}/model", torch_dtype=torch.float32)
      torch_model.eval()
      ids = torch.tensor(prompts, dtype=torch.long)
      kwargs = dict(max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False, use_cache=True)
      rate = 0.0
      with torch.no_grad():
        torch_model.generate(ids, **kwargs)
        for _ in range(args.repeats):
          start = time.perf_counter()
          hf_out = torch_model.generate(ids, **kwargs)
          rate = max(rate, batch * args.new / (time.perf_counter() - start))
      same = np.mean(hf_out[:, args.prompt :].numpy() == outputs["linen"])
      print(
          f"{batch:>5} {'HF eager (torch CPU)':>22} {'':>14} {rate:>13.1f} {decode_rate / rate:>10.2f}x <  ({same:.0%} tokens equal)"
      )


if __name__ == "__main__":
  main()
