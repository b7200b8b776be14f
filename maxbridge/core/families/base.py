"""What a family entry names, and the facts several families share.

Pure Python, like the config that reads it: no jax, so the command line can
check a config before JAX starts.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from maxbridge.core.families import attention
from maxbridge.core.families.attention import query_kernel_carries_scale  # noqa: F401  (re-exported)

# A `maxbridge.core.config.Config`; that module reads the registry, so this package cannot import it.
Config = Any
# Cache entry name -> its per-token shape (`maxbridge.ops.kv_cache` adds the batch and sequence axes).
CacheEntries = dict[str, tuple[int, ...]]
# The module of a recurrent sub-layer (`Stack.recurrent`) that holds its decode state.
RECURRENT_MIXER = "linear_attention"


@dataclasses.dataclass(frozen=True)
class Stack:
  """One stack of identical decoder layers: its name in the canonical tree, its layer kind, and its depth.

  Each backend maps a layer kind to its layer class (`LAYER_CLASSES` in decoders.py).
  """

  name: str
  kind: str
  depth: Callable[[Config], int] = lambda config: config.num_decoder_layers
  # A stack of blocks of several Hugging Face layers (Gemma 2's local then global layer):
  # each block's sub-layer names, in depth order; () for a stack of single layers.
  sublayers: tuple[str, ...] = ()
  # How a block names its sub-layers' modules (`canonical.sublayer_path`): nested
  # (`local/self_attention`), or, as MaxText's Gemma2DecoderLayer does, suffixed
  # (`self_attention_local`), so that MaxText's checkpoints load as they are.
  suffixed: bool = False
  # The sub-layers whose mixer is recurrent (Qwen3-Next's gated DeltaNet, `RECURRENT_MIXER`): while decoding
  # they keep the family's `recurrent_state`, not a KV cache.
  recurrent: tuple[str, ...] = ()
  # Sub-layer -> the ring its decode cache keeps (`ops.kv_cache`), where it sees no further back than that: Llama
  # 4's chunked layers, their chunk. Others cache every token, or the family's sliding window (`kv_cache.window`).
  rings: Callable[[Config], Mapping[str, int]] = lambda config: {}
  # Sub-layer -> what its decode cache holds where it differs from the family's `cache_entries` (Gemma 4's global
  # layers, with their own head width and key/value heads).
  caches: Callable[[Config], Mapping[str, CacheEntries]] = lambda config: {}
  # Whether its layers keep a decode cache: Gemma 4's KV-shared layers keep none, they read an earlier layer's.
  cached: bool = True


@dataclasses.dataclass(frozen=True)
class ClipPiece:
  """QK-Clip multiplies [start, stop) of `feature_axis` by s ** power, per head."""

  feature_axis: int
  start: int
  stop: int
  power: float


# Path under a layer -> (head axis, pieces), in the unscanned leaf's axes.
ClipTargets = dict[str, tuple[int, tuple[ClipPiece, ...]]]


@dataclasses.dataclass(frozen=True)
class Family:
  """One decoder family: everything outside its layer files that differs by family, as data."""

  decoder_blocks: tuple[str, ...]  # the config's `decoder_block` values it serves
  stacks: tuple[Stack, ...]  # in depth order
  # The layers' and the final norm: "rms_norm", "layer_norm" (with a bias), or "zero_centred_rms_norm" (Qwen3-Next:
  # `scale` holds w of the multiplier 1 + w and starts at zero, so weight decay pulls the multiplier toward 1).
  norm: str
  # Whether the query kernel holds attention's 1/sqrt(head_dim) (see `query_kernel_carries_scale`).
  query_kernel_carries_scale: bool
  cache_entries: Callable[[Config], CacheEntries]  # what one attention layer caches while decoding
  qk_clip_targets: Callable[[Config], ClipTargets]  # the weights QK-Clip rescales, per layer
  # Hugging Face architectures (`hf_rules.HFFamily`) exported as one of `decoder_blocks`.
  hf: tuple[Any, ...]
  # The config's family rules: one message per rule broken (naming the keys at fault), none when valid.
  check: Callable[[Config], list[str]] = lambda config: []
  # Whether a windowed layer's decode cache is a ring of its window; False where
  # only some layers are windowed (Gemma 2): every layer then caches every token.
  ring_cache: bool = True
  # Whether sliding-window and global layers take their own RoPE (local_rope_max_timescale,
  # rope_linear_scaling_factor: `ops.rotary.layer_rope`); elsewhere those keys must stay unset.
  layer_rope: bool = False
  # MaxText keys whose value this family fixes (MaxText's model yml for it sets them,
  # maxbridge computes only that): they override `config_rules`' fixed values.
  maxtext_fixed: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  # Config keys only this family reads -> the value every other family must leave them at (its base.yml default).
  own_keys: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  # The vision tower use_multimodal=true builds (each backend's `vision` module), None where the family has none.
  vision_tower: str | None = None
  # What one recurrent sub-layer (`Stack.recurrent`) keeps while decoding: entry name -> its per-row shape
  # (`maxbridge.ops.kv_cache` adds the batch axis); None where no layer is recurrent.
  recurrent_state: Callable[[Config], CacheEntries] | None = None
  # The experts' routing when the family fixes it (`ops.moe`'s score_func: Llama 4's "topk_sigmoid", which MaxText's
  # RoutedMoE also picks by decoder block); None reads routed_score_func.
  routing: str | None = None
  # The kind of carry the layers pass on where it is more than the hidden states (Gemma 4's per-layer inputs and
  # shared keys/values): each backend's decoder builds it (`LAYER_CARRIES` in decoders.py) and its layers read it.
  layer_carry: str | None = None
  # Its layers' attention (`attention.AttentionSpec`), by kind of layer: (config, *, local, kv_shared) -> spec.
  attention: Callable[..., attention.AttentionSpec] = attention.standard

  def layer_stacks(self, config: Config) -> tuple[tuple[str, int], ...]:
    """(stack name, number of layers) of the non-empty stacks, in depth order."""
    depths = ((stack.name, stack.depth(config)) for stack in self.stacks)
    return tuple((name, depth) for name, depth in depths if depth)

  def mtp_stack(self, config: Config) -> Stack:
    """The stack whose layer kind each multi-token prediction module runs: that of the model's last layer."""
    name = self.layer_stacks(config)[-1][0]
    return next(stack for stack in self.stacks if stack.name == name)


def key_value_cache(config: Config, kv_heads: int | None = None) -> CacheEntries:
  """Keys and values per token: [kv heads, head_dim] each (`kv_heads`, by default the config's)."""
  kv_heads = config.num_kv_heads if kv_heads is None else kv_heads
  return {"cached_key": (kv_heads, config.head_dim), "cached_value": (kv_heads, config.head_dim)}


def query_kernel_clip(config: Config) -> ClipTargets:
  """The query kernel [D, N, H] of grouped-query / multi-head attention: by s, per query head.

  Keys are shared by several query heads, so they cannot carry a per-head factor.
  """
  return {"self_attention/query/kernel": (1, (ClipPiece(2, 0, config.head_dim, 1.0),))}


# --- config rules several families share; each returns its message, or None -----------------------


def own_positions(config: Config) -> str | None:
  if config.rope_type != "default":
    return (
        f"rope_type={config.rope_type!r} scales the RoPE of Llama-style attention; decoder_block={config.decoder_block!r} has "
        "its own positions: set rope_type='default'"
    )
  return None


def routes_to_experts(config: Config) -> str | None:
  if config.num_experts < 2:
    return f"decoder_block={config.decoder_block!r} routes tokens to experts: num_experts must be >= 2"
  return None


def no_grouped_query_attention(config: Config) -> str | None:
  if config.base_num_query_heads != config.base_num_kv_heads:
    return (
        f"decoder_block={config.decoder_block!r} has no grouped-query attention: base_num_kv_heads="
        f"{config.base_num_kv_heads} must equal base_num_query_heads={config.base_num_query_heads}"
    )
  return None


def own_attention(config: Config) -> str | None:
  if config.sliding_window_size or config.use_qk_norm:
    return (
        f"decoder_block={config.decoder_block!r} has its own attention, which reads neither sliding_window_size="
        f"{config.sliding_window_size} nor use_qk_norm={config.use_qk_norm}: leave them at 0 and false"
    )
  return None


def broken(*messages: str | None) -> list[str]:
  """The messages of the rules that are broken (the others are None)."""
  return [message for message in messages if message]
