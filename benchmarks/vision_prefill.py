"""Prefill throughput with images: `mb.Engine.prefill(prompt, images=...)` on Linen and NNX, interleaved.

    .venv/bin/python benchmarks/vision_prefill.py [--images 1 2] [--image-size 224] [--soft-tokens 64]
                                                  [--vit-width 128] [--vit-layers 4] [--rounds 10]

One set of random weights (gemma3-tiny's decoder under a SigLIP tower of the given size, `use_multimodal=true`),
one prompt per row count: text, then each image's boi, soft tokens and eoi, then text. Each round prefills it once
on each backend, in a fresh random order (`bench.interleaved`); the figures are medians, the ratio the median of
per-round ratios. Image tokens/s counts the soft tokens the prefill filled from pixels (the tower's work); prompt
tokens/s every token of the prompt. The first call of each (trace and compile) is not timed.
"""

import argparse
import statistics
import time

import jax
import numpy as np

import maxbridge as mb
from maxbridge.models import dispatch
from maxbridge.serving import engine
from maxbridge.training import bench


def config(backend: str, args, images: int) -> mb.Config:
  patches = args.image_size // args.patch
  prompt = 16 + images * (args.soft_tokens + 2)
  return mb.load_config(
      "gemma3-tiny",
      use_multimodal=True,
      image_size_for_vit=args.image_size,
      patch_size_for_vit=args.patch,
      conv_stride_for_vit=args.patch,
      hidden_size_for_vit=args.vit_width,
      intermediate_size_for_vit=4 * args.vit_width,
      num_hidden_layers_for_vit=args.vit_layers,
      num_attention_heads_for_vit=4,
      vision_output_length=min(args.soft_tokens, patches * patches),
      max_prefill_predict_length=1 << (prompt - 1).bit_length(),
      max_target_length=2 * (1 << (prompt - 1).bit_length()),
      decode_sampling_strategy="greedy",
      **dispatch.backend_flags(backend),
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--images", type=int, nargs="+", default=[1, 2], help="images per prompt, one row each")
  parser.add_argument("--image-size", type=int, default=224)
  parser.add_argument("--patch", type=int, default=14)
  parser.add_argument("--soft-tokens", type=int, default=64, help="vision_output_length (a square)")
  parser.add_argument("--vit-width", type=int, default=128)
  parser.add_argument("--vit-layers", type=int, default=4)
  parser.add_argument("--rounds", type=int, default=10)
  args = parser.parse_args()
  print(
      f"jax {jax.__version__} on {jax.devices()[0].device_kind}; {args.image_size}px images, tower width "
      f"{args.vit_width} x {args.vit_layers} blocks, {args.soft_tokens} soft tokens per image"
  )
  print(f"{'images':>6} {'backend':>7} {'prefill ms':>10} {'image tok/s':>11} {'prompt tok/s':>12} {'time/linen':>10}")
  for count in args.images:
    engines = {}
    for backend in ("linen", "nnx"):
      cfg = config(backend, args, count)
      engines[backend] = engine.Engine(cfg, model=dispatch.create_model(cfg, seed=0))
    image = [cfg.boi_token_index, *[cfg.image_token_index] * cfg.vision_output_length, cfg.eoi_token_index]
    prompt = np.asarray([*range(2, 10), *image * count, *range(20, 28)], np.int32)
    pixels = np.random.default_rng(0).standard_normal((count, args.image_size, args.image_size, 3)).astype(np.float32)

    def timer(eng):
      def seconds() -> float:
        start = time.perf_counter()
        jax.block_until_ready(eng.prefill(prompt, images=pixels).logits)
        return time.perf_counter() - start

      return seconds

    times = bench.interleaved({name: timer(eng) for name, eng in engines.items()}, args.rounds, warmup=1)
    soft = count * engines["linen"].config.vision_output_length
    for name in engines:
      median = statistics.median(times[name])
      ratio = bench.median_ratio(times[name], times["linen"])
      print(f"{count:>6} {name:>7} {median * 1e3:10.1f} {soft / median:11.0f} {len(prompt) / median:12.0f} {ratio:10.3f}")


if __name__ == "__main__":
  main()
