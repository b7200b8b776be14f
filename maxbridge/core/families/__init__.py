"""The family registry: one entry of pure data per decoder family, looked up by `decoder_block`.

An entry (`Family`) names its stacks and their layer kinds, its norm, whether
the query kernel carries attention's scale, its decode cache entries, its
QK-Clip targets, its Hugging Face architectures and its config rules. Code
outside this package asks the entry (`config.family`) and never compares
`decoder_block` with a family's name; each backend maps a layer kind to its
layer class. A new family is one module here and one line in `REGISTRY`.
Pure Python (no jax), like the config that validates against it.
"""

from maxbridge.core.families import deepseek, gemma, gemma3, gemma4, glm4_moe, gpt3, gpt_oss, llama, llama4, mixtral, olmo2, olmo3, qwen2, qwen3_5, qwen3_moe, qwen3_next
from maxbridge.core.families.base import ClipPiece, Family, Stack, query_kernel_carries_scale

REGISTRY: tuple[Family, ...] = (
    llama.FAMILY,
    gpt3.FAMILY,
    mixtral.FAMILY,
    deepseek.FAMILY,
    olmo2.FAMILY,
    olmo3.FAMILY,
    qwen2.FAMILY,
    qwen3_moe.FAMILY,
    qwen3_next.FAMILY,
    gemma.GEMMA,
    gemma.GEMMA2,
    gemma3.FAMILY,
    gemma4.FAMILY,
    gpt_oss.FAMILY,
    llama4.FAMILY,
    glm4_moe.FAMILY,
    qwen3_5.FAMILY,
)

# Every `decoder_block` value, by MaxText's names: llama2 (also Mistral and Qwen3 through
# sliding_window_size / use_qk_norm), gpt3 (GPT-2/3), mixtral (MoE), deepseek (MLA + MoE).
DECODER_BLOCKS: tuple[str, ...] = tuple(block for family in REGISTRY for block in family.decoder_blocks)
# Every stack name, for the canonical tree's layer paths ("layers", DeepSeek's "dense_layers", "moe_layers").
STACK_NAMES: tuple[str, ...] = tuple(dict.fromkeys(stack.name for family in REGISTRY for stack in family.stacks))

_BY_BLOCK = {block: family for family in REGISTRY for block in family.decoder_blocks}
if len(_BY_BLOCK) != len(DECODER_BLOCKS):
  raise ValueError(f"a decoder_block is served by two families: {DECODER_BLOCKS}")


class UnknownFamily(ValueError):
  """A `decoder_block` no family serves; the message lists those that are."""


def lookup(decoder_block: str) -> Family:
  """The family entry that serves `decoder_block`."""
  try:
    return _BY_BLOCK[decoder_block]
  except KeyError:
    listed = ", ".join(repr(block) for block in DECODER_BLOCKS)
    raise UnknownFamily(f"decoder_block={decoder_block!r} has no family entry; valid values: {listed}") from None


__all__ = [
    "DECODER_BLOCKS",
    "REGISTRY",
    "STACK_NAMES",
    "ClipPiece",
    "Family",
    "Stack",
    "UnknownFamily",
    "lookup",
    "query_kernel_carries_scale",
]
