"""The Hugging Face architectures of the registered families, looked up by config.json's model_type.

Each family's tables (a `Rule` per tensor: Hugging Face name pattern ->
canonical path + transform) and config translations live in its module of
`maxbridge.core.families`; the generic pieces (`Rule`, the transforms, the
config.json readers, `HFError`) in `maxbridge.core.families.hf_rules`. They are
re-exported here under their names of old. `maxbridge.interop.hf.mapping`
applies them.
"""

from maxbridge.core import families
from maxbridge.core.families.hf_rules import (
    CONFIG_FILE,
    HF_CONFIG_SIDECAR,
    INDEX_FILE,
    WEIGHTS_FILE,
    Copy,
    HFError,
    Linear,
    Part,
    Piece,
    Reshape,
    Rule,
    family_for_config,
)
from maxbridge.core.families.hf_rules import HFFamily as Family

FAMILIES: tuple[Family, ...] = tuple(hf for family in families.REGISTRY for hf in family.hf)


def family_for_model_type(model_type: str | None) -> Family:
  for family in FAMILIES:
    if family.model_type == model_type:
      return family
  known = ", ".join(f.model_type for f in FAMILIES)
  raise HFError(f"{CONFIG_FILE}: model_type={model_type!r} is not supported; supported: {known}")


__all__ = [
    "CONFIG_FILE",
    "FAMILIES",
    "HF_CONFIG_SIDECAR",
    "INDEX_FILE",
    "WEIGHTS_FILE",
    "Copy",
    "Family",
    "HFError",
    "Linear",
    "Part",
    "Piece",
    "Reshape",
    "Rule",
    "family_for_config",
    "family_for_model_type",
]
