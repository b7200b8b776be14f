"""Any Flax Linen model and its checkpoints onto the NNX twin its authors write, proven equal layer by layer.

`match` maps every leaf of a Linen variables tree onto an NNX module's state (a printable `Plan`),
`convert` applies it both ways (parameters, any collection, optax state, step), `compare` runs both and
names the first submodule where they part. `maxbridge migrate` is the command line; docs/migrate.md the guide.
"""

from maxbridge.migrate.compare import Comparison, Difference, compare
from maxbridge.migrate.convert import Converted, convert
from maxbridge.migrate.leaves import MigrateError
from maxbridge.migrate.match import DEFAULT_EXPECTED, Plan, Rule, load_rules, match

__all__ = [
    "DEFAULT_EXPECTED",
    "Comparison",
    "Converted",
    "Difference",
    "MigrateError",
    "Plan",
    "Rule",
    "compare",
    "convert",
    "load_rules",
    "match",
]
