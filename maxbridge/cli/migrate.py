"""`maxbridge migrate`: a user's own Flax Linen model and its checkpoints moved to its NNX twin."""

import argparse

from maxbridge.cli.args import DEBUG_HELP, Verb, tolerance


def _add_migrate(verbs) -> None:
  p = verbs.add_parser(
      "migrate",
      help="move your own Flax Linen model and its checkpoints to its NNX twin (docs/migrate.md)",
      description="check: match a Linen module's variables to its NNX twin, convert them, and compare outputs and "
      "gradients, naming the first submodule that differs (exit 0 agree, 1 differ, 2 error). convert: turn a "
      "Linen orbax checkpoint (TrainState or variables) into one the NNX twin restores, after comparing the two "
      "on its weights as check does (exit 0 done; 2 error or the twin differs, nothing written).",
  )
  actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
  for action, text in (("check", "compare the two modules layer by layer"), ("convert", "convert a checkpoint")):
    a = actions.add_parser(action, help=text)
    if action == "convert":
      a.add_argument("source", help="Linen orbax checkpoint (item, step or CheckpointManager directory)")
      a.add_argument("destination", help="new directory for the NNX checkpoint (never overwritten)")
    a.add_argument(
        "--linen",
        required=True,
        metavar="MOD:FN",
        help="pkg.module:function or file.py:function returning the Linen module",
    )
    a.add_argument(
        "--nnx",
        required=True,
        metavar="MOD:FN",
        help="function returning the NNX module, or (module, nnx.Optimizer) to convert the optimizer state too",
    )
    a.add_argument("--rules", help="YAML file of extra rules: rules: [{linen: REGEX, nnx: PATH, transpose: [1, 0]}]")
    a.add_argument(
        "--input-shape",
        required=action == "check",
        metavar="N,N,..",
        help="shape of a float input"
        + (" (the twin is compared on random inputs of it before anything is written)" if action == "convert" else ""),
    )
    a.add_argument(
        "--linen-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="keyword argument of the Linen module's call, e.g. train=false (repeatable)",
    )
    a.add_argument("--atol", type=tolerance, default=1e-6, help="absolute tolerance (default 1e-6)")
    if action == "convert":
      a.add_argument(
          "--allow-mismatch",
          action="store_true",
          help="write the checkpoint even if the twin's outputs differ from the Linen model's (or, without "
          "--input-shape, were not compared); a warning says so",
      )
    a.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help=DEBUG_HELP)


def _migrate(args: argparse.Namespace) -> int:
  import yaml

  linen_kwargs = {}
  for item in args.linen_arg:
    key, sep, value = item.partition("=")
    if not sep or not key.isidentifier():
      raise ValueError(f"--linen-arg {item!r}: expected name=value, e.g. train=false")
    linen_kwargs[key] = yaml.safe_load(value)
  from maxbridge.migrate import checkpoint

  shape = checkpoint.parse_shape(args.input_shape) if args.input_shape else None
  if args.action == "check":
    if shape is None:
      raise ValueError("migrate check needs --input-shape, e.g. --input-shape 2,28,28,1")
    plan, comparison = checkpoint.check(
        args.linen, args.nnx, shape, rules=args.rules, linen_kwargs=linen_kwargs, atol=args.atol
    )
    print(plan)
    print(comparison)
    return 0 if comparison.ok else 1
  plan, comparison = checkpoint.convert_checkpoint(
      args.source,
      args.destination,
      args.linen,
      args.nnx,
      rules=args.rules,
      input_shape=shape,
      linen_kwargs=linen_kwargs,
      atol=args.atol,
      allow_mismatch=args.allow_mismatch,
  )
  print(f"{args.destination}: {plan.__str__().splitlines()[0].removeprefix('migrate plan: ')}")
  print(str(comparison).splitlines()[0] if comparison is not None else "outputs not compared (no --input-shape)")
  return 0


MIGRATE = Verb("migrate", _add_migrate, _migrate)
