"""`maxbridge import-hf`, `export-hf`, `quantize` and `lora-merge`: checkpoints in and out of other formats."""

import argparse

from maxbridge.cli.args import CONFIG_HELP, Verb, add_overrides, boolean


def _add_import_hf(verbs) -> None:
  p = verbs.add_parser(
      "import-hf",
      help="import a Hugging Face checkpoint folder",
      description="Reads config.json + model.safetensors (or a sharded index) of a llama, mistral, "
      "qwen3, gpt2, mixtral or deepseek_v3 model and writes a params-only maxbridge checkpoint "
      "(DESTINATION/0/items, config.yml). Exit 0 done, 2 error (nothing written).",
  )
  p.add_argument("source", help="Hugging Face model folder")
  p.add_argument("destination", help="new directory to write the maxbridge checkpoint to")
  p.add_argument(
      "--scan-layers",
      type=boolean,
      metavar="{true,false}",
      help="store the layers stacked (default: base.yml's scan_layers)",
  )
  p.add_argument("--dtype", choices=["float32", "bfloat16"], help="parameter dtype to store (default float32)")
  add_overrides(p)


def _import_hf(args: argparse.Namespace) -> int:
  from maxbridge.interop import hf

  out = hf.import_hf(args.source, args.destination, *args.overrides, scan_layers=args.scan_layers, dtype=args.dtype)
  print(f"{out}: params-only checkpoint at step 0, with config.yml")
  return 0


IMPORT_HF = Verb("import-hf", _add_import_hf, _import_hf)


def _add_export_hf(verbs) -> None:
  p = verbs.add_parser(
      "export-hf",
      help="export a checkpoint as a Hugging Face folder",
      description="Writes DESTINATION/config.json + model.safetensors, which transformers loads, with the "
      "checkpoint's tokenizer files (those a run or import-hf keeps beside its config.yml). "
      "Exit 0 done, 2 error (nothing written).",
  )
  p.add_argument("source", help="checkpoint or run directory (with its config.yml)")
  p.add_argument("destination", help="new Hugging Face folder to write")
  p.add_argument("--dtype", choices=["float32", "bfloat16"], help="tensor dtype (default: the checkpoint's)")
  p.add_argument("--config", help=CONFIG_HELP)


def _export_hf(args: argparse.Namespace) -> int:
  from maxbridge.interop import pretrained

  out = pretrained.export_hf(args.source, args.destination, dtype=args.dtype, config=args.config)
  print(f"{out}: config.json + model.safetensors")
  return 0


EXPORT_HF = Verb("export-hf", _add_export_hf, _export_hf)


def _add_quantize(verbs) -> None:
  p = verbs.add_parser(
      "quantize",
      help="make a serve checkpoint (frozen int8 weights) from a float checkpoint",
      description="Reads a float checkpoint (maxbridge, MaxText with --config, an imported or raw Hugging Face "
      "folder, or a preset/YAML whose load_parameters_path names one) and writes DESTINATION/0/items + "
      "config.yml with checkpoint_is_quantized=true: every quantized kernel as kernel_qvalue + kernel_scale. "
      "Needs quantization=int8 (AQT), or use_qwix_quantization=true with quantization=int8, int4 or fp8 (Qwix "
      "PTQ). Exit 0 done, 2 error (nothing written).",
  )
  p.add_argument("source", help="checkpoint, run or Hugging Face folder; or a preset/YAML with load_parameters_path")
  p.add_argument("destination", help="new directory to write the serve checkpoint to")
  p.add_argument("--config", help=CONFIG_HELP)
  add_overrides(p)


def _quantize(args: argparse.Namespace) -> int:
  from maxbridge.interop import quantize

  out = quantize.quantize_checkpoint(args.source, args.destination, *args.overrides, config=args.config)
  print(
      f"{out}: serve checkpoint (quantized values and scales in place of float kernels) at step {_step(out)}, with config.yml"
  )
  return 0


QUANTIZE = Verb("quantize", _add_quantize, _quantize)


def _add_lora_merge(verbs) -> None:
  p = verbs.add_parser(
      "lora-merge",
      help="merge a LoRA run's adapters into its base: a plain checkpoint",
      description="Writes BASE + lora_alpha/lora_rank * A @ B (DESTINATION/0/items, config.yml), which "
      "export-hf, generate and train read like any checkpoint. BASE must be the base the adapters were "
      "trained on (its fingerprint is checked). Exit 0 done, 2 error (nothing written).",
  )
  p.add_argument("base", help="Hugging Face folder or checkpoint the adapters were trained on")
  p.add_argument("adapters", help="the LoRA run, its checkpoints or a step directory (the latest step is read)")
  p.add_argument("destination", help="new directory to write the merged checkpoint to")


def _lora_merge(args: argparse.Namespace) -> int:
  from maxbridge.interop import lora_merge

  out = lora_merge.merge_checkpoint(args.base, args.adapters, args.destination)
  print(f"{out}: params-only checkpoint at step {_step(out)} (base + adapters), with config.yml")
  return 0


LORA_MERGE = Verb("lora-merge", _add_lora_merge, _lora_merge)


def _step(checkpoints) -> int:
  from maxbridge.core import checkpointing

  return checkpointing.resolve(checkpoints)[1]
