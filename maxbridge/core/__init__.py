"""The core layer: what every other layer stands on, and nothing of a model's wiring.

Configuration (`config`, `config_rules`), the canonical parameter tree
(`canonical`), checkpoint storage in our layout (`checkpointing`, `layouts`),
files written atomically (`files`), the device mesh and logical axis rules
(`sharding`), canonical initial values (`initializers`) and the Linen <-> NNX
wrappers (`bridge`). Imports nothing of maxbridge above it.
"""
