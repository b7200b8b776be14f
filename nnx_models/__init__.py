"""Flax NNX decoder families. Mirrors linen_models/ file for file."""

# The process-wide NNX settings every model here relies on (no eager sharding,
# attribute-style sow) live in maxbridge.core.bridge; importing a model sets them.
from maxbridge.core import bridge as _bridge  # noqa: F401, E402
