"""`maxbridge migrate`: a user's own Flax Linen model and its checkpoints moved to its NNX twin."""

import argparse

from maxbridge.cli.args import DEBUG_HELP, Verb, tolerance


def _add_migrate(verbs) -> None:
  p = verbs.add_parser(
      "migrate",
      help="move your own Flax Linen model and its checkpoints to its NNX twin (docs/migrate.md)",
      description="check: match a Linen module's variables to its NNX twin, convert them, and compare outputs and "
      "gradients, naming the first submodule that differs (exit 0 agree, 1 differ, 2 error). convert: turn a "
      "Linen orbax checkpoint (TrainState or variables) into one the NNX twin restores (exit 0 done, 2 error, "
      "nothing written).",
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
        help="shape of a float input" + (" (checks the checkpoint against the module)" if action == "convert" else ""),
    )
    a.add_argument(
        "--linen-arg",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="keyword argument of the Linen module's call, e.g. train=false (repeatable)",
    )
    if action == "check":
      a.add_argument("--atol", type=tolerance, default=1e-6, help="absolute tolerance (default 1e-6)")
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
  plan = checkpoint.convert_checkpoint(
      args.source, args.destination, args.linen, args.nnx, rules=args.rules, input_shape=shape, linen_kwargs=linen_kwargs
  )
  print(f"{args.destination}: {plan.__str__().splitlines()[0].removeprefix('migrate plan: ')}")
  return 0


MIGRATE = Verb("migrate", _add_migrate, _migrate)
