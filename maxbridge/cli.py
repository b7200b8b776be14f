"""The `maxbridge` command: one verb per workflow, configuration as key=value."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from maxbridge.config import ConfigError, load_config

Handler = Callable[[argparse.Namespace], int]

# Exit status of a verb that is declared but not built yet: argparse's
# "usage error" code, so scripts can tell it from success.
NOT_YET = 2


def _train(args: argparse.Namespace) -> int:
    # Imported here: jax loads only for the verbs that need it. (maxbridge.train
    # the function shadows the module of that name on the package.)
    from maxbridge.checkpointing import CheckpointError
    from maxbridge.train import TrainingDiverged, run_directory, train

    config = load_config(args.preset, *args.overrides)
    try:
        records = train(config)
    except TrainingDiverged as e:
        print(f"maxbridge train: {e}", file=sys.stderr)
        return 1
    except CheckpointError as e:
        print(f"maxbridge train: {e}", file=sys.stderr)
        return 2
    run_dir = run_directory(config)
    if records:
        print(f"{run_dir}: step {records[-1]['step']} loss {records[-1]['loss']:.4f}")
    else:
        print(f"{run_dir}: already trained to step {config.steps}; nothing to do")
    return 0


def _later(verb: str) -> Handler:
    def handler(args: argparse.Namespace) -> int:
        print(f"{verb}: arrives in a later issue", file=sys.stderr)
        return NOT_YET

    return handler


HANDLERS: dict[str, Handler] = {
    "train": _train,
    "convert": _later("convert"),
    "compare": _later("compare"),
    "import-hf": _later("import-hf"),
    "export-hf": _later("export-hf"),
    "generate": _later("generate"),
    "bench": _later("bench"),
}


def _overrides(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="config overrides, e.g. steps=20 pure_nnx=true"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="maxbridge",
        description="One transformer in Flax Linen and NNX. Configuration is key=value, as in MaxText.",
    )
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="COMMAND")

    p = verbs.add_parser("train", help="train a model from a preset or YAML file")
    p.add_argument("preset", help="preset name (e.g. llama-tiny) or path to a YAML config")
    _overrides(p)

    p = verbs.add_parser("convert", help="convert a checkpoint between backends or layouts")
    p.add_argument("source", help="checkpoint or run directory to read")
    p.add_argument("destination", help="directory to write the converted checkpoint to")
    _overrides(p)

    p = verbs.add_parser("compare", help="compare two checkpoints' parameters and logits")
    p.add_argument("first", help="checkpoint or run directory")
    p.add_argument("second", help="checkpoint or run directory")
    _overrides(p)

    p = verbs.add_parser("import-hf", help="import a Hugging Face checkpoint folder")
    p.add_argument("source", help="Hugging Face model folder")
    p.add_argument("destination", help="directory to write the maxbridge checkpoint to")
    _overrides(p)

    p = verbs.add_parser("export-hf", help="export a checkpoint as a Hugging Face folder")
    p.add_argument("source", help="checkpoint or run directory")
    p.add_argument("destination", help="Hugging Face folder to write")
    _overrides(p)

    p = verbs.add_parser("generate", help="generate text from a checkpoint or preset")
    p.add_argument("source", help="checkpoint, run directory, preset or YAML config")
    p.add_argument("--prompt", default="", help="text to continue")
    _overrides(p)

    p = verbs.add_parser("bench", help="time Linen, NNX and mixed backends side by side")
    p.add_argument("preset", help="preset name or path to a YAML config")
    _overrides(p)

    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return HANDLERS[args.verb](args)
    except ConfigError as e:
        print(f"maxbridge {args.verb}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
