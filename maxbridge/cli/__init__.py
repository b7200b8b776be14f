"""The `maxbridge` command: one verb per workflow, configuration as key=value.

Exit status: 0 done; 2 bad input (a file, key, path or shape the message
names, which the user can fix); 1 an internal failure, or a run that diverged;
128 + N a signal N (SIGINT, SIGTERM). Errors print one message, no traceback,
unless `--debug` is given or MAXBRIDGE_DEBUG=1 is set.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import threading
import time
import traceback
import warnings
from collections.abc import Sequence

from maxbridge.cli import checkpoints, data, interop, migrate, serving, training
from maxbridge.cli.args import BAD_INPUT, DEBUG_ENV, DEBUG_HELP, INTERNAL, Handler

# Seconds a finished command waits for threads a library left running before it exits anyway.
EXIT_GRACE_S = 5.0

# Each verb's parser beside its handler, one module per group of verbs; in the order `maxbridge --help` lists them.
VERBS = (
    training.TRAIN,
    checkpoints.CONVERT,
    checkpoints.COMPARE,
    checkpoints.VERIFY,
    interop.IMPORT_HF,
    interop.EXPORT_HF,
    interop.QUANTIZE,
    interop.LORA_MERGE,
    serving.GENERATE,
    serving.SERVE,
    training.SHARDINGS,
    training.COMPILE,
    training.DISTILL_LOGITS,
    training.BENCH,
    migrate.MIGRATE,
    data.DATA,
)
HANDLERS: dict[str, Handler] = {verb.name: verb.run for verb in VERBS}


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="maxbridge",
      description="One transformer in Flax Linen and NNX. Configuration is key=value, as in MaxText. "
      "Exit 0 done, 2 bad input (one line names it), 1 internal failure.",
  )
  parser.add_argument("--debug", action="store_true", help=DEBUG_HELP)
  verbs = parser.add_subparsers(dest="verb", required=True, metavar="COMMAND")
  for verb in VERBS:
    verb.add_parser(verbs)
  for sub in verbs.choices.values():
    # After the verb too; SUPPRESS keeps the subparser from resetting `maxbridge --debug VERB`.
    sub.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)
  return parser


_OVERRIDE = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*=")


def _is_override(text: str) -> bool:
  return bool(_OVERRIDE.match(text)) and not os.path.exists(text)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
  """argparse, except that key=value overrides may come anywhere: before, between or after options."""
  parser = build_parser()
  args, extras = parser.parse_known_args(argv)
  if not hasattr(args, "overrides"):
    return parser.parse_args(argv)  # no overrides here: argparse names anything unknown
  if any(x.startswith("-") for x in extras):
    parser.parse_args(argv)  # exits 2, naming the option it does not know
  # A key=value before the preset or paths takes their place in argparse's eyes: sort them out.
  names = [name for name in ("preset", "source", "destination") if hasattr(args, name)]
  given = [getattr(args, name) for name in names] + list(args.overrides) + list(extras)
  positional = [x for x in given if not _is_override(x)]
  named = [x.partition("=")[2] for x in given if _is_override(x) and x.startswith("model_name=")]
  if names[:1] == ["preset"] and not positional and named:
    positional = named[-1:]  # MaxText's model_name=<preset> in place of the preset
  if len(positional) < len(names):
    parser.error(f"the following arguments are required: {', '.join(names[len(positional):])}")
  if len(positional) > len(names):
    parser.error(f"unexpected argument(s) {positional[len(names):]}; config overrides are key=value")
  for name, value in zip(names, positional):
    setattr(args, name, value)
  args.overrides = [x for x in given if _is_override(x)]
  return args


def _is_bad_input(error: BaseException) -> bool:
  # Our errors (ConfigError, CheckpointError, ConversionError, HFError) are ValueErrors;
  # OSError covers a missing file, a full disk, a read-only folder.
  return isinstance(error, (ValueError, OSError, NotImplementedError))


def _report(verb: str, error: BaseException, debug: bool) -> int:
  """Prints `error` for a person: one message, the traceback only when asked for; the exit status."""
  if debug:
    traceback.print_exception(error)
  message = str(error)
  notes = "".join(f"\n  {note}" for note in getattr(error, "__notes__", ()))
  if isinstance(error, KeyboardInterrupt):
    print(f"maxbridge {verb}: {message or 'interrupted'}{notes}", file=sys.stderr)
    return 128 + getattr(error, "signum", 2)
  if _is_bad_input(error):
    print(f"maxbridge {verb}: {message}{notes}", file=sys.stderr)
    return BAD_INPUT
  hint = "" if debug else f" (run with --debug or {DEBUG_ENV}=1 for the traceback)"
  if isinstance(error, ArithmeticError):  # a run that diverged says all there is to say
    print(f"maxbridge {verb}: {message}{notes}", file=sys.stderr)
  else:
    print(f"maxbridge {verb}: internal error: {type(error).__name__}: {message}{notes}{hint}", file=sys.stderr)
  return INTERNAL


def main(argv: Sequence[str] | None = None) -> int:
  """Runs one command; returns its exit status. Called with no `argv` it is the process's
  entry point, and also makes sure the process ends (see `_exit_promptly`)."""
  args = parse_args(argv)
  debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
  if argv is None and not debug:
    _quiet_library_tracebacks()
  try:
    code = HANDLERS[args.verb](args)
  except (Exception, KeyboardInterrupt) as e:  # pylint: disable=broad-exception-caught
    code = _report(args.verb, e, debug)
  if argv is None:
    _exit_promptly(code)
  return code


def _drop_traceback(record: logging.LogRecord) -> bool:
  record.exc_info, record.exc_text = None, None
  return True


def _quiet_library_tracebacks() -> None:
  """Libraries log the errors of their threads with a traceback (orbax, for a failed save); the
  command reports the error itself, in one message. Their one-line log messages stay, and
  warnings print as one line."""
  # orbax and jax log through absl; asyncio logs, whenever the garbage collector gets to them,
  # the failed writes of orbax's save tasks that no one awaited once the first had failed.
  for logger in (logging.getLogger("absl"), logging.getLogger("asyncio")):
    if _drop_traceback not in logger.filters:
      logger.addFilter(_drop_traceback)
  # tensorstore's callbacks report theirs as unraisable (after a failed save, orbax's event
  # loop is closed under them); each distinct one becomes a line.
  seen = set()

  def one_line(kind, value):
    line = f"{kind.__name__}: {value}"
    if line not in seen:
      seen.add(line)
      print(f"maxbridge: a library reported {line}", file=sys.stderr)

  sys.unraisablehook = lambda unraisable: one_line(unraisable.exc_type, unraisable.exc_value)
  sys.excepthook = lambda kind, value, tb: one_line(kind, value)
  warnings.formatwarning = lambda message, category, *rest, **kw: f"maxbridge: warning: {message}\n"


def _exit_promptly(code: int) -> None:
  """Exits now if a library left a non-daemon thread running after the command ended.

  Python waits for such threads at exit, for ever if they wait on each other
  (orbax's commit threads after a failed save did). The command's own work is
  done: a save in flight was waited for (`Checkpointer.close`).
  """
  deadline = time.monotonic() + EXIT_GRACE_S
  for thread in threading.enumerate():
    if thread is not threading.current_thread() and not thread.daemon:
      thread.join(max(0.0, deadline - time.monotonic()))
  if any(t.is_alive() and not t.daemon and t is not threading.current_thread() for t in threading.enumerate()):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
