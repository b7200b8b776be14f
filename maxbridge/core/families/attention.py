"""A layer's attention as data: what each backend's one `Attention` layer builds and computes.

A family entry's `attention` (`Family.attention`) gives the spec of each kind
of layer it has: a sliding-window or chunked (`local`) layer or a full one, and
whether it reads an earlier layer's keys and values (`kv_shared`, Gemma 4). A
family whose attention is Llama's (with Mistral's window or Qwen3's QK-norm,
which the config turns on) keeps `standard` and writes no attention code.
Only attention whose parameter tree is not this one's has a class of its own
(GPT-3's fused `qkv_proj`, DeepSeek's MLA, Qwen3-Next's gated DeltaNet).
Pure Python, like the rest of the registry.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

Config = Any  # `maxbridge.core.config.Config` (which reads the registry, so cannot be imported here)

# Per-head query/key norms with a learned `scale` [head_dim], applied before RoPE.
RMS_NORM, ZERO_CENTRED_RMS_NORM = "rms_norm", "zero_centred_rms_norm"
ACROSS_HEADS = "across_heads"  # one RMSNorm over all heads together, its `scale` [heads * head_dim] (OLMo 2)
L2 = "l2"  # no parameter, after RoPE (Llama 4)

# How queries and keys turn (`ops.attention.rotate`).
ROPE = "rope"  # `ops.rotary.layer_rope` of a full layer: the config's RoPE, for every family without per-layer RoPE
LOCAL_ROPE = "local_rope"  # `layer_rope` of a sliding-window layer (Gemma 2-4's local_rope_max_timescale)
INTERLEAVED_ROPE = "interleaved_rope"  # pairs (2i, 2i + 1), Hugging Face's complex product (Llama 4)
PARTIAL_ROPE = "partial_rope"  # the first `rotary_dim` dims of each head only (Qwen3-Next)
PROPORTIONAL_ROPE = "proportional_rope"  # `rotary_pairs` of each head's pairs (Gemma 4's global layers)
NO_ROPE = "no_rope"  # NoPE (Llama 4's global layers)

# Where a layer's keys and values come from.
OWN_KV = "own"  # `key` and `value` kernels
VALUE_IS_KEY = "value_is_key"  # `key` only; the values are its projection before the key's norm and RoPE (Gemma 4)
SHARED_KV = "shared"  # no kernels: an earlier layer's keys and values (Gemma 4's KV-shared layers)


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
  """One kind of layer's attention. The first fields decide its parameters (so its canonical paths), the rest
  only what it computes."""

  head_dim: int
  kv_heads: int
  qkv_bias: bool = False  # biases on the query, key and value projections (gpt-oss, Qwen2)
  out_bias: bool = False  # a bias on the out projection (gpt-oss; not Qwen2)
  sinks: bool = False  # one sink logit per query head (gpt-oss): `ops.attention.softmax_with_sinks`
  qk_norm: str | None = None  # RMS_NORM, ZERO_CENTRED_RMS_NORM, ACROSS_HEADS, L2, or None
  output_gate: bool = False  # `query` also projects a per-head gate; the output is times sigmoid(gate) (Qwen3-Next)
  kv: str = OWN_KV
  value_norm: bool = False  # an RMSNorm without a scale on the values (Gemma 4)
  rope: str = ROPE
  rotary_dim: int = 0  # PARTIAL_ROPE's turned dims
  rotary_pairs: int = 0  # PROPORTIONAL_ROPE's turned pairs
  sliding_window_size: int = 0
  chunk_size: int = 0  # Llama 4's chunked attention
  # Whether the decode cache is a ring (of the window or chunk), not every token.
  ring_cache: bool = False
  # Multiplies the queries at run time; None where the query kernel carries it (`query_kernel_carries_scale`).
  query_scale: float | None = None
  logits_soft_cap: float = 0.0
  temperature_tuning: bool = False  # Llama 4's NoPE layers (`ops.attention.temperature_tuning`)
  # Whether later layers read what this one attends over (Gemma 4's KV sharing): its cache is then written before
  # attention reads it (`update_cache`), since a write deferred past its own read would come before theirs.
  shares_kv: bool = False


def standard(config: Config, *, local: bool = False, kv_shared: bool = False) -> AttentionSpec:
  """Llama's grouped-query attention, as the config turns it: Mistral's sliding window, Qwen3's per-head QK-norm."""
  del local, kv_shared  # every layer alike
  return AttentionSpec(
      head_dim=config.head_dim,
      kv_heads=config.num_kv_heads,
      qk_norm=RMS_NORM if config.use_qk_norm else None,
      sliding_window_size=config.sliding_window_size,
      ring_cache=ring_cache(config),
      query_scale=run_time_scale(config, config.head_dim),
  )


def query_kernel_carries_scale(config: Config) -> bool:
  """Whether the query kernel holds attention's 1/sqrt(head_dim), so that attention does not scale at run time.

  MaxText's Llama numerics fold the factor into the query kernel (DESIGN.md).
  Elsewhere it cannot be folded: query/key norms (Qwen3) would undo it, MLA
  (DeepSeek) scales by 1/sqrt(nope + rope) at run time as MaxText and Hugging
  Face do, and GPT-2/3's fused `qkv_proj` has no query kernel of its own. The
  initializers, the attention layers and the Hugging Face mapping all ask here.
  """
  return config.family.query_kernel_carries_scale and not config.use_qk_norm


def run_time_scale(config: Config, width: int) -> float | None:
  """1/sqrt(`width`), or None where the query kernel carries it."""
  return None if query_kernel_carries_scale(config) else width**-0.5


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's 0.1 * mscale * ln(factor) + 1, 1 where factor <= 1 (transformers' `yarn_get_mscale`): the factor on the
  rotated queries and keys (`ops.rotary.YarnScaling`), and DeepSeek's on the softmax scale (`ops.mla`)."""
  return 0.1 * mscale * math.log(factor) + 1.0 if factor > 1 else 1.0


def ring_cache(config: Config) -> bool:
  """Whether a windowed layer's decode cache is a ring of its window (`ops.kv_cache.window` > 0)."""
  return bool(config.sliding_window_size) and config.family.ring_cache
