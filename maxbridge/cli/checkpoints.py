"""`maxbridge convert`, `compare` and `verify`: checkpoints on disk, through `converters`."""

import argparse
import sys

from maxbridge.cli.args import BAD_INPUT, CONFIG_HELP, Verb, boolean, tolerance


def _add_convert(verbs) -> None:
  p = verbs.add_parser(
      "convert",
      help="convert a checkpoint between layouts (linen, nnx), scanned and unscanned, dtypes",
      description="Converts a checkpoint array by array into DESTINATION/<step>/items; "
      "the source's layout is detected. Exit 0 done, 2 error (nothing written).",
  )
  p.add_argument("source", help="run, checkpoints, step or items directory (the latest step is read)")
  p.add_argument("destination", help="checkpoints directory to create (e.g. runs/new/checkpoints)")
  p.add_argument("--layout", choices=["linen", "nnx"], help="on-disk layout to write (default: the source's)")
  p.add_argument(
      "--scan-layers", type=boolean, metavar="{true,false}", help="stack or unstack the layers (default: as the source)"
  )
  p.add_argument(
      "--param-scan-axis",
      type=int,
      choices=(0, 1),
      metavar="N",
      help="layer axis to stack or unstack on (default: the source config's, else 1)",
  )
  p.add_argument("--dtype", choices=["float32", "bfloat16"], help="cast floating-point arrays, optimizer state included")
  p.add_argument("--params-only", action="store_true", help="drop optimizer state and step (a decode checkpoint)")
  p.add_argument("--force", action="store_true", help="replace DESTINATION if it exists")
  p.add_argument("--config", help=CONFIG_HELP + "; written with the result")


def _convert(args: argparse.Namespace) -> int:
  import converters  # jax and orbax load only for the verbs that need them

  conversion = converters.convert(
      args.source,
      args.destination,
      layout=args.layout,
      scan_layers=args.scan_layers,
      param_scan_axis=args.param_scan_axis,
      dtype=args.dtype,
      params_only=args.params_only,
      force=args.force,
      config=args.config,
  )
  print(conversion.summary())
  return 0


CONVERT = Verb("convert", _add_convert, _convert)


def _add_compare(verbs) -> None:
  p = verbs.add_parser(
      "compare",
      help="compare two checkpoints in any layouts",
      description="Normalises both checkpoints (layout, leaf wrappers, scanned vs unscanned) and "
      "compares structure, shapes, dtypes and values. Exit 0 equal, 1 different, 2 error.",
  )
  p.add_argument("first", help="run, checkpoints, step or items directory")
  p.add_argument("second", help="run, checkpoints, step or items directory")
  p.add_argument("--atol", type=tolerance, default=0.0, help="absolute tolerance (default 0)")
  p.add_argument("--rtol", type=tolerance, default=0.0, help="relative tolerance (default 0)")
  p.add_argument("--params-only", action="store_true", help="compare parameters only")
  p.add_argument("--metadata-only", action="store_true", help="compare structure, shapes and dtypes, reading no data")


def _compare(args: argparse.Namespace) -> int:
  import converters

  comparison = converters.compare(
      args.first,
      args.second,
      atol=args.atol,
      rtol=args.rtol,
      params_only=args.params_only,
      metadata_only=args.metadata_only,
  )
  print(comparison.report())
  return 0 if comparison.equal else 1


COMPARE = Verb("compare", _add_compare, _compare)


def _add_verify(verbs) -> None:
  p = verbs.add_parser(
      "verify",
      help="check every array of a checkpoint, or of every step of a run, against its saved digest",
      description="Reads every array (no model is built) and compares it with the digest recorded when it was "
      "saved; prints one line per step. Exit 0 all clean, 2 any step damaged (or a bad path).",
  )
  p.add_argument("path", help="run, checkpoints (every step), step or items directory (that step)")


def _verify(args: argparse.Namespace) -> int:
  import converters

  checks = converters.verify(args.path)
  for check in checks:
    print(check.line())
  damaged = [c for c in checks if not c.ok]
  if not damaged:
    return 0
  good = [c for c in checks if c.ok]
  intact = f"; the latest step that verified is {good[-1].where}" if good else ""
  print(f"maxbridge verify: {len(damaged)} of {len(checks)} checkpoint(s) damaged{intact}", file=sys.stderr)
  return BAD_INPUT  # as a damaged checkpoint is for every other verb


VERIFY = Verb("verify", _add_verify, _verify)
