"""Decoding with a KV cache, below the engine: the canonical cache tree and `Model.generate`'s loop.

The cache is one canonical tree on both backends (`abstract_cache`), given to
the model's attention layers as Linen's "cache" collection or as `nnx.Cache`
variables (`Model.cached_forward`); the model itself never holds one.
"""

import functools
from typing import Any

import jax
import jax.numpy as jnp

from maxbridge.core import canonical
from maxbridge.core.config import Config
from maxbridge.core.families.base import RECURRENT_MIXER
from maxbridge.ops import kv_cache, sampling

Params = dict[str, Any]


def abstract_cache(config: Config, batch: int, length: int, *, ring: bool = True) -> Params:
  """The canonical decode cache tree of `config` for `batch` rows of `length` tokens, as shapes.

  A windowed layer holds a ring of its window's entries (`ops.kv_cache`);
  `ring=False` gives it all `length`, as a packed prefill needs.

  `decoder/<stack>/self_attention/<entry>` (`ops.kv_cache`), stacked on a
  leading layer axis when `scan_layers` (where nn.scan and the NNX stack keep
  layer state), else one `<stack>_<i>` per layer: the same on both backends.
  """
  layer = kv_cache.abstract(config, batch, length, ring=ring)
  # A block of sub-layers (Gemma 2's) has one attention per sub-layer; a recurrent sub-layer (Qwen3-Next's
  # DeltaNet, `Stack.recurrent`) keeps its fixed-size state instead.
  stacks = {stack.name: stack for stack in config.family.stacks}
  flat = {}
  for stack, count in canonical.layer_stacks(config):
    own = stacks[stack]
    if not own.cached:
      continue
    rings, caches = own.rings(config), own.caches(config)

    def attention_cache(sub):
      if sub in rings:
        return kv_cache.abstract(config, batch, length, ring=ring, ring_length=rings[sub])
      if sub in caches:
        return kv_cache.abstract(config, batch, length, ring=ring, own_entries=caches[sub])
      return layer

    subs = [
        (canonical.sublayer_path(sub, RECURRENT_MIXER, own.suffixed), kv_cache.recurrent_abstract(config, batch))
        if sub in own.recurrent
        else (canonical.sublayer_path(sub, "self_attention", own.suffixed), attention_cache(sub))
        for sub in own.sublayers
    ]
    for attention, entries in subs or [("self_attention", layer)]:
      for name, leaf in entries.items():
        if config.scan_layers:
          flat[f"decoder/{stack}/{attention}/{name}"] = jax.ShapeDtypeStruct((count, *leaf.shape), leaf.dtype)
        else:
          for i in range(count):
            flat[f"decoder/{stack}_{i}/{attention}/{name}"] = leaf
  return canonical.unflatten(flat)


def has_ring(config: Config) -> bool:
  """Whether any layer's decode cache is a ring: the sliding window's (`kv_cache.window`) or its own (`Stack.rings`)."""
  return bool(kv_cache.window(config)) or any(stack.rings(config) for stack in config.family.stacks)


def cache_logical_axes(config: Config) -> Params:
  """Logical axis names of every cache leaf ("layers" first when stacked), for sharding."""
  stacked = ("layers",) if config.scan_layers else ()
  flat = canonical.flatten(abstract_cache(config, 1, 1))
  return canonical.unflatten({path: stacked + kv_cache.logical_axes(path.rsplit("/", 1)[1]) for path in flat})


def init_cache(config: Config, batch: int, length: int, *, ring: bool = True) -> Params:
  """An empty cache: zeros, so segment 0 everywhere and nothing visible."""
  return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), abstract_cache(config, batch, length, ring=ring))


def decode_config(config: Config) -> Config:
  """The configuration a decoding model runs: `config` with its layers unrolled (see the module docstring).

  Decoding runs no pipeline: a pipeline's stage devices split the decode slots
  as data parallelism does, so the mesh keeps its devices.
  """
  changes = {"scan_layers": False} if config.scan_layers else {}
  for kind in ("ici", "dcn"):
    stages, data = getattr(config, f"{kind}_pipeline_parallelism"), getattr(config, f"{kind}_data_parallelism")
    if stages != 1:
      changes[f"{kind}_pipeline_parallelism"] = 1
      changes[f"{kind}_data_parallelism"] = data if data == -1 else data * stages
  return config.replace(**changes) if changes else config


def generate_tokens(
    model: Any, params: Params, prompt: jax.Array, temperature, rng: jax.Array, *, max_new_tokens: int, sample: bool
) -> jax.Array:
  """int32 prompts [B, T] (all T real) for `model` (an `mb.Model`) -> prompt + continuation [B, T + N], with a cache of T + N tokens.

  `Model.generate`'s loop: one prefill of the whole batch, then N - 1 cached
  steps in one compiled loop. Weighted at `temperature` when `sample`, else greedy.
  """
  batch, length = prompt.shape
  sample = functools.partial(sampling.sample, strategy="weighted" if sample else "greedy", temperature=temperature)
  cache = init_cache(model.config, batch, length + max_new_tokens)
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), prompt.shape)
  logits, cache = model.cached_forward(params, cache, prompt, positions, jnp.ones_like(prompt))
  rng, step_rng = jax.random.split(rng)
  tokens = jnp.zeros((batch, max_new_tokens), jnp.int32).at[:, 0].set(sample(logits[:, -1], step_rng))
  ones = jnp.ones((batch, 1), jnp.int32)

  def step(i, carry):
    tokens, cache, rng = carry
    last = jax.lax.dynamic_slice_in_dim(tokens, i - 1, 1, axis=1)
    logits, cache = model.cached_forward(params, cache, last, ones * (length + i - 1), ones)
    rng, step_rng = jax.random.split(rng)
    return jax.lax.dynamic_update_slice_in_dim(tokens, sample(logits, step_rng), i, axis=1), cache, rng

  tokens, _, _ = jax.lax.fori_loop(1, max_new_tokens, step, (tokens, cache, rng))
  return jnp.concatenate([prompt, tokens], axis=1)
