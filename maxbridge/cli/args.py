"""What the verbs share: exit statuses, argument types that say what they expect, config overrides, help texts."""

import argparse
import math
from collections.abc import Callable
from typing import NamedTuple

Handler = Callable[[argparse.Namespace], int]

BAD_INPUT = 2
INTERNAL = 1
DEBUG_ENV = "MAXBRIDGE_DEBUG"
DEBUG_HELP = f"show the traceback of an error (or set {DEBUG_ENV}=1)"
CONFIG_HELP = (
    "preset or YAML file describing a checkpoint that has no config.yml (MaxText's); where one has, it must agree "
    "with it on what the model computes (refused otherwise), and sets how it runs"
)


class Verb(NamedTuple):
  """One verb of the command: its name, what adds its parser to the verbs' subparsers, and its handler."""

  name: str
  add_parser: Callable[[argparse._SubParsersAction], None]
  run: Handler


def count(text: str) -> int:
  """A whole number >= 0 (argparse's int() also takes "-2")."""
  try:
    value = int(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
  if value < 0:
    raise argparse.ArgumentTypeError(f"{text!r} must be >= 0")
  return value


def tolerance(text: str) -> float:
  """A finite float >= 0 (float() also takes "nan", "-1" and "inf")."""
  try:
    value = float(text)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
  if not (math.isfinite(value) and value >= 0):
    raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
  return value


def boolean(text: str) -> bool:
  words = {"true": True, "1": True, "yes": True, "false": False, "0": False, "no": False}
  if text.strip().lower() not in words:
    raise argparse.ArgumentTypeError(f"{text!r} is not true or false")
  return words[text.strip().lower()]


def add_overrides(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. steps=20 pure_nnx=true")
