"""`maxbridge generate` and `serve`: a model decoded by `mb.Engine`, once or behind an HTTP server."""

import argparse
import os

from maxbridge.cli.args import CONFIG_HELP, Verb, add_overrides, count, tolerance
from maxbridge.core.config import load_config, override_values


def _add_generate(verbs) -> None:
  p = verbs.add_parser(
      "generate",
      help="generate text from a checkpoint, Hugging Face folder or preset",
      description="Samples as mb.Engine does, by the decode_sampling_* keys (greedy by default). Uses SOURCE's "
      "tokenizer.json (a Hugging Face folder's, or the one a run trained with tokenizer_path keeps beside its "
      "config.yml), or tokenizer_path=FOLDER when given; without one, UTF-8 bytes as tokens (with a warning). "
      "A preset gives a randomly initialised model.",
  )
  p.add_argument("source", help="Hugging Face folder, checkpoint or run directory, preset or YAML config")
  p.add_argument("--prompt", default="", help="text to continue")
  p.add_argument(
      "--max-new-tokens",
      type=count,
      default=None,
      help="tokens to generate (default 32, or fewer where the prompt and 32 would pass max_target_length)",
  )
  p.add_argument(
      "--temperature",
      type=tolerance,
      default=None,
      help="0 decodes greedily; T > 0 sets decode_sampling_temperature=T and samples (weighted, unless "
      "decode_sampling_strategy is topk or nucleus). Default: the decode_sampling_* keys as they are",
  )
  p.add_argument("--seed", type=int, default=None, help="sampling seed (default: the config's seed)")
  p.add_argument(
      "--image",
      action="append",
      default=[],
      metavar="PATH",
      help="an image for the next of the prompt's image placeholders (the config's image_placeholder), in order; "
      "repeatable; a model with a vision tower (use_multimodal=true) only",
  )
  p.add_argument(
      "--backend",
      choices=["linen", "nnx"],
      default=None,
      help="model backend (default: the checkpoint's config.yml, else NNX as base.yml sets it)",
  )
  p.add_argument("--config", help=CONFIG_HELP)
  add_overrides(p)


def _generate(args: argparse.Namespace) -> int:
  model = _load_model(args)
  text = model_tokenizer(args, model.config.vocab_size)
  prompt_text, images = _with_images(args, model.config)
  prompt = text.encode(prompt_text)
  if not prompt:
    raise ValueError("--prompt is empty: give at least one token to continue")
  new_tokens = args.max_new_tokens
  if new_tokens is None:  # as many as fit in the trained length, up to 32: a default call never warns past it
    new_tokens = min(32, max(1, model.config.max_target_length - len(prompt)))
  from maxbridge.serving import engine

  # The engine's own sampling: the decode_sampling_* keys, which --temperature and --seed set when given.
  config = model.config
  if args.temperature == 0:
    config = config.replace(decode_sampling_strategy="greedy")
  elif args.temperature is not None:
    strategy = "weighted" if config.decode_sampling_strategy == "greedy" else config.decode_sampling_strategy
    config = config.replace(decode_sampling_strategy=strategy, decode_sampling_temperature=args.temperature)
  if args.seed is not None:
    config = config.replace(seed=args.seed)  # the parameters are made already: this seeds sampling alone
  continuation = engine.generate_continuation(config, model, prompt, new_tokens, images=images)
  print(text.decode([*prompt, *(int(t) for t in continuation)]))
  return 0


def _with_images(args: argparse.Namespace, config):
  """(the prompt, its image placeholders expanded to the image tokens; the --image files preprocessed, or None)."""
  if not args.image:
    return args.prompt, None
  if not config.use_multimodal:
    raise ValueError(
        f"--image needs a model with a vision tower (use_multimodal=true); {args.source} is "
        f"decoder_block={config.decoder_block!r} without one"
    )
  from maxbridge.interop import images as image_io

  placeholders = args.prompt.count(config.image_placeholder)
  if placeholders != len(args.image):
    raise ValueError(
        f"--prompt holds {placeholders} image placeholders ({config.image_placeholder!r}, the config's "
        f"image_placeholder) for {len(args.image)} --image files: give one placeholder per image"
    )
  folder = args.source if os.path.isdir(args.source) else None
  pixels = image_io.load_images(args.image, image_size=config.image_size_for_vit, folder=folder)
  return image_io.expand_placeholders(args.prompt, config.image_placeholder, config.vision_output_length), pixels


GENERATE = Verb("generate", _add_generate, _generate)


def _add_serve(verbs) -> None:
  p = verbs.add_parser(
      "serve",
      help="serve a checkpoint, Hugging Face folder or preset over an OpenAI-compatible HTTP API",
      description="POST /v1/completions and /v1/chat/completions (streamed or whole), GET /v1/models, /health, "
      "/metrics. Continuous batching over per_device_batch_size slots per device; prompts up to "
      "max_prefill_predict_length, prompt and completion up to max_target_length. SIGTERM drains and exits 0.",
  )
  p.add_argument("source", help="Hugging Face folder, checkpoint or run directory, preset or YAML config")
  p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
  p.add_argument("--port", type=_port, default=8000, help="port to listen on, 0..65535 (default 8000)")
  p.add_argument("--model-name", default=None, help="the model's name in the API (default: SOURCE's last part)")
  p.add_argument("--max-queue", type=count, default=64, help="requests waiting for a slot before 429 (default 64)")
  p.add_argument(
      "--max-request-bytes",
      type=count,
      default=8 * 2**20,
      help="larger request bodies are answered 413 unread (default 8 MiB)",
  )
  p.add_argument(
      "--shutdown-timeout", type=tolerance, default=30.0, help="seconds SIGTERM lets requests finish (default 30)"
  )
  p.add_argument(
      "--allowed-local-media-path",
      default=None,
      metavar="DIR",
      help="chat image parts may name files under DIR as file:// URLs (vLLM's flag); without it only data: URLs",
  )
  p.add_argument("--backend", choices=["linen", "nnx"], default=None, help="model backend (as for generate)")
  p.add_argument("--config", help=CONFIG_HELP)
  add_overrides(p)


def _serve(args: argparse.Namespace) -> int:
  from pathlib import Path

  from maxbridge.serving import chat_content, engine, server

  sock = server.bind(args.host, args.port)  # a port in use fails now, not after the model loads and the banner
  model = _load_model(args)
  codec = serve_codec(args, model_tokenizer(args, model.config.vocab_size))
  images = chat_content.ImageSources(args.source if Path(args.source).is_dir() else None, args.allowed_local_media_path)
  chat_content.Vision.of(model.config, images)  # what it refuses, refused before the banner
  serving = engine.Engine(model.config, model=model)
  port = sock.getsockname()[1]  # --port 0: the one the system chose
  print(
      f"maxbridge serve: {args.source} on http://{args.host}:{port}/v1 ({serving.max_concurrent_decodes} slots)",
      flush=True,
  )
  server.serve(
      serving,
      codec,
      sock=sock,
      model_name=args.model_name or Path(args.source).name,
      max_queue=args.max_queue,
      max_request_bytes=args.max_request_bytes,
      shutdown_timeout=args.shutdown_timeout,
      images=images,
  )
  return 0


def _port(text: str) -> int:
  """A TCP port, 0..65535 (int() takes 70000, which the socket layer would wrap to 4464)."""
  value = count(text)
  if value > 65535:
    raise argparse.ArgumentTypeError(f"{text!r} is not a TCP port (0..65535)")
  return value


SERVE = Verb("serve", _add_serve, _serve)


def _load_model(args: argparse.Namespace):
  """The model `generate` and `serve` run: SOURCE's checkpoint or Hugging Face folder, or a preset's."""
  from pathlib import Path

  from maxbridge.core import checkpointing
  from maxbridge.interop import pretrained
  from maxbridge.models import dispatch

  flags = pretrained.backend_overrides(args.backend)
  if Path(args.source).is_dir():
    config, params = pretrained.load_pretrained(args.source, *args.overrides, config=args.config, **flags)
    return dispatch.create_model(config, params=params)
  # A preset or YAML file: MaxText's load_parameters_path, else a random model for smoke tests.
  config = load_config(args.source, *args.overrides, **flags)
  path = config.load_parameters_path or config.load_full_state_path
  return dispatch.create_model(config, params=checkpointing.load_params(path)[0] if path else None)


def model_tokenizer(args: argparse.Namespace, vocab_size: int):
  """The model's tokenizer (`pretrained.model_tokenizer`): SOURCE's, or a tokenizer_path= override, which is used
  (refused when its ids do not fit vocab_size; `tokenizer_path=` empty: bytes)."""
  from maxbridge.interop import pretrained

  return pretrained.model_tokenizer(args.source, vocab_size, override_values(args.overrides).get("tokenizer_path"))


def serve_codec(args: argparse.Namespace, text):
  """What `serve` encodes and decodes with: `text` (`model_tokenizer`), with the chat template, special tokens and
  end-of-sequence ids of its folder (SOURCE's, for bytes)."""
  from pathlib import Path

  from maxbridge.serving import codec

  folder = text.folder or Path(args.source)
  return codec.Codec.from_folder(text.encode, text.decode, folder, text.token_strs)
