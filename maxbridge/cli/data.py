"""`maxbridge data`: a Grain corpus looked at as a run reads it, or converted to ArrayRecord."""

import argparse
import sys

from maxbridge.cli.args import DEBUG_HELP, Verb, add_overrides, count
from maxbridge.core.config import load_config


def _add_data(verbs) -> None:
  p = verbs.add_parser(
      "data",
      help="look at a Grain corpus as the run reads it, or convert one to ArrayRecord",
      description="inspect: a dataset_type=grain config's documents, tokens, padding and a few decoded rows. "
      "convert: JSONL, Parquet or text files (a file, folder or glob) to a new folder of ArrayRecord files, "
      "one per source file, with progress (exit 0 done, 2 bad input, nothing written).",
  )
  actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
  a = actions.add_parser("inspect", help="decoded rows, token count and padding of a grain config")
  a.add_argument("preset", help="preset name or YAML config with dataset_type=grain")
  a.add_argument("--batches", type=count, default=2, help="batches to read (default 2)")
  add_overrides(a)
  a.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
  a = actions.add_parser("convert", help="write ArrayRecord from JSONL, Parquet or text")
  a.add_argument("source", help="JSONL, Parquet or .txt file, folder or glob")
  a.add_argument("destination", help="new folder for the .arrayrecord files (never overwritten)")
  a.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)


def _data(args: argparse.Namespace) -> int:
  from maxbridge.training import grain_data  # grain (and jax) load only for this verb

  if args.action == "inspect":
    config = load_config(args.preset, *args.overrides)
    if config.dataset_type != "grain":
      raise ValueError(f"data inspect reads dataset_type=grain configs, got dataset_type={config.dataset_type!r}")
    print(grain_data.inspect(config, batches=args.batches))
  else:
    written = grain_data.convert(args.source, args.destination, progress=sys.stderr.isatty())
    print(
        f"{args.destination}: {len(written)} ArrayRecord file(s); train on them with dataset_type=grain "
        f"grain_train_files={args.destination}"
    )
  return 0


DATA = Verb("data", _add_data, _data)
