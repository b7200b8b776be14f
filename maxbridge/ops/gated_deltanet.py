"""Gated DeltaNet (Qwen3-Next's linear attention) as pure functions: gating, short convolution, delta rule.

A linear-attention layer keeps, per value head, a state matrix S [k_dim, v_dim]
in place of a KV cache. Each token first decays it, S <- exp(g) S, then writes
the part of its value that S does not yet predict, scaled by beta:
S <- S + beta k (v - S^T k)^T (the delta rule), and reads o = S^T q. Queries
and keys are L2-normalised and queries also scaled by k_dim ** -0.5.

Two forms compute the same outputs and final state (they agree to float32
precision; tests/test_qwen3_next.py):
- `chunked_gated_delta_rule`, for training and prefill: within a chunk of C
  tokens the delta rule's updates are condensed into matmuls by the UT
  transform (one unit-lower-triangular solve), and a `lax.scan` carries S from
  chunk to chunk. No custom kernel, so it runs on every backend;
- `recurrent_gated_delta_rule`, for decode: `gated_delta_step` per token.

The math follows transformers' pure-torch fallbacks for Qwen3-Next
(`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
`causal_conv1d_fn` / `causal_conv1d_update`), written for JAX.

Segments (`segment_ids` [B, T], as attention takes them): a token whose
segment differs from the one before starts afresh (zero state, and the
convolution sees nothing before it), so packed sequences do not leak into
one another. Segment 0 is padding: a padding token neither decays nor writes
the state, and the convolution window after a call is the last W-1 inputs
before any trailing padding, so a right-padded prompt leaves the state of its
last real token. Without `segment_ids`, the whole row is one sequence.

Shapes: queries and keys [B, T, Hk, K], values [B, T, Hv, V], g and beta
[B, T, Hv], the state [B, Hv, K, V]. With Hv > Hk (grouped value heads), each
query/key head serves Hv // Hk consecutive value heads, as in transformers.
Everything runs in float32 and returns in the values' dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# transformers' (and fla's) epsilon of the query/key L2 norm.
L2_NORM_EPSILON = 1e-6


def gating(a: jax.Array, b: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The per-token, per-value-head decay g (a log, <= 0) and write strength beta in (0, 1).

  g = -exp(A_log) * softplus(a + dt_bias), Mamba 2's discretised decay;
  beta = sigmoid(b). `a`, `b` [..., Hv]; `a_log`, `dt_bias` [Hv]. In float32:
  exp(A_log) overflows float16.
  """
  g = -jnp.exp(a_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
  return g, jax.nn.sigmoid(b.astype(jnp.float32))


def l2_normalize(x: jax.Array, epsilon: float = L2_NORM_EPSILON) -> jax.Array:
  """x * rsqrt(sum(x^2) + eps) over the last axis, in float32 (fla's and transformers' `l2norm`)."""
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True) + epsilon)


def runs(segment_ids: jax.Array) -> jax.Array:
  """[B, T] -> the index of each token's run of state: 0 up to the first segment change, +1 at each change.

  A change to a non-zero segment starts a run; padding (segment 0) stays in
  the run before it (it is a no-op there). Runs only grow along a row.
  """
  previous = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=0)
  starts = (segment_ids != previous) & (segment_ids != 0)
  starts = starts.at[:, 0].set(False)  # the first token continues the given state or window
  return jnp.cumsum(starts, axis=1, dtype=jnp.int32)


def _real_length(segment_ids: jax.Array) -> jax.Array:
  """[B, T] -> [B]: one past the last non-padding token (0 if all padding)."""
  steps = jnp.arange(1, segment_ids.shape[1] + 1, dtype=jnp.int32)
  return jnp.max(jnp.where(segment_ids != 0, steps, 0), axis=1)


def causal_conv1d(
    x: jax.Array, kernel: jax.Array, window: jax.Array | None = None, segment_ids: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
  """Causal depthwise convolution of x [B, T, C] by kernel [W, C] (tap W-1 meets the current token), no bias.

  `window` [B, W-1, C] holds the inputs of the W-1 tokens before x (zeros
  before the first token; None means zeros). Returns the output [B, T, C],
  before any activation, and the window after x: the last W-1 inputs up to
  its last non-padding token, what the next call continues from. One token
  (T=1) is a decode step. With `segment_ids`, a tap never reads across a
  segment change (`runs`).
  """
  width, channels = kernel.shape
  if x.ndim != 3 or x.shape[-1] != channels:
    raise ValueError(f"causal_conv1d: x {x.shape} must be [B, T, C] with C = the kernel's {channels} channels")
  if window is None:
    window = jnp.zeros((x.shape[0], width - 1, channels), x.dtype)
  if window.shape != (x.shape[0], width - 1, channels):
    raise ValueError(f"causal_conv1d: window {window.shape} must be [B, W-1, C] = {(x.shape[0], width - 1, channels)}")
  batch, steps = x.shape[:2]
  if segment_ids is not None:
    x = jnp.where((segment_ids != 0)[..., None], x, 0)  # padding feeds nothing forward, as transformers zeroes it
  padded = jnp.concatenate([window.astype(x.dtype), x], axis=1)  # [B, W-1+T, C]
  k32 = kernel.astype(jnp.float32)
  # W shifted products (W is 4 in Qwen3-Next): cheaper to read than a grouped convolution, and exact.
  if segment_ids is None:
    out = sum(padded[:, tap : tap + steps].astype(jnp.float32) * k32[tap] for tap in range(width))
    return out.astype(x.dtype), padded[:, steps:]
  run = jnp.pad(runs(segment_ids), ((0, 0), (width - 1, 0)))  # the window's inputs belong to run 0
  out = sum(
      padded[:, tap : tap + steps].astype(jnp.float32)
      * k32[tap]
      * (run[:, tap : tap + steps] == run[:, width - 1 :])[..., None]
      for tap in range(width)
  )
  end = _real_length(segment_ids)  # the window after x ends at its last real token
  taken = jnp.arange(width - 1)[None, :] + end[:, None]  # [B, W-1] indices into padded
  return out.astype(x.dtype), jnp.take_along_axis(padded, taken[..., None], axis=1)


def _repeat_heads(q: jax.Array, k: jax.Array, value_heads: int) -> tuple[jax.Array, jax.Array]:
  key_heads = k.shape[2]
  if value_heads % key_heads:
    raise ValueError(f"gated delta rule: {value_heads} value heads must be a multiple of the {key_heads} key heads")
  groups = value_heads // key_heads
  return jnp.repeat(q, groups, axis=2), jnp.repeat(k, groups, axis=2)


def _check(q, k, v, g, beta, state) -> None:
  batch, steps = v.shape[:2]
  if q.shape != k.shape or q.shape[:2] != (batch, steps):
    raise ValueError(
        f"gated delta rule: queries {q.shape} and keys {k.shape} must be [B, T, Hk, K] like values {v.shape}"
    )
  if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
    raise ValueError(f"gated delta rule: g {g.shape} and beta {beta.shape} must be [B, T, Hv] = {v.shape[:3]}")
  expected = (batch, v.shape[2], k.shape[3], v.shape[3])
  if state is not None and state.shape != expected:
    raise ValueError(f"gated delta rule: state {state.shape} must be [B, Hv, K, V] = {expected}")


def _prepare(q, k, v, g, beta, state, segment_ids):
  """Heads repeated, float32, queries scaled, time axis second to last ([B, H, T, .]), a zero state if None,
  padding made a no-op (g = 0, beta = 0), and each token's run [B, T] (`runs`)."""
  _check(q, k, v, g, beta, state)
  if segment_ids is None:
    run = jnp.zeros(v.shape[:2], jnp.int32)
  else:
    if segment_ids.shape != v.shape[:2]:
      raise ValueError(f"gated delta rule: segment_ids {segment_ids.shape} must be [B, T] = {v.shape[:2]}")
    real = (segment_ids != 0)[..., None]
    g, beta = jnp.where(real, g, 0), jnp.where(real, beta, 0)
    run = runs(segment_ids)
  q, k = _repeat_heads(q, k, v.shape[2])
  q = q.astype(jnp.float32) * q.shape[-1] ** -0.5
  q, k, v = (jnp.swapaxes(x.astype(jnp.float32), 1, 2) for x in (q, k, v))
  g, beta = (jnp.swapaxes(x.astype(jnp.float32), 1, 2) for x in (g, beta))
  if state is None:
    state = jnp.zeros(v.shape[:2] + (k.shape[-1], v.shape[-1]), jnp.float32)
  return q, k, v, g, beta, state.astype(jnp.float32), run


def gated_delta_step(
    state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array
) -> tuple[jax.Array, jax.Array]:
  """One token: state [..., K, V], q and k [..., K] (q already scaled), v [..., V], g and beta [...].

  Returns (the new state, the output [..., V]), in float32.
  """
  state = state * jnp.exp(g)[..., None, None]
  predicted = jnp.einsum("...kv,...k->...v", state, k)
  state = state + k[..., :, None] * ((v - predicted) * beta[..., None])[..., None, :]
  return state, jnp.einsum("...kv,...k->...v", state, q)


def recurrent_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
  """The delta rule token by token: (outputs [B, T, Hv, V], final state [B, Hv, K, V] float32).

  q and k are the L2-normalised queries and keys (`l2_normalize`); queries are
  scaled by K ** -0.5 here. `state` (None: zeros) is the state before token 0.
  """
  dtype = v.dtype
  q, k, v, g, beta, state, run = _prepare(q, k, v, g, beta, state, segment_ids)
  starts = run != jnp.pad(run[:, :-1], ((0, 0), (1, 0)))  # [B, T]: a new run empties the state

  def step(state, xs):
    start, *token = xs
    return gated_delta_step(jnp.where(start[:, None, None, None], 0.0, state), *token)

  time_major = [jnp.moveaxis(x, 2, 0) for x in (q, k, v, g, beta)]
  state, out = jax.lax.scan(step, state, [starts.T, *time_major])  # out [T, B, H, V]
  return jnp.moveaxis(out, 0, 1).astype(dtype), state


def chunked_gated_delta_rule(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array,
    beta: jax.Array,
    state: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
    *,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:
  """The delta rule by chunks of `chunk_size` tokens: the same outputs and final state as `recurrent_gated_delta_rule`.

  Within a chunk, with cumulative log decays c_i and the chunk's starting state S:
  the tokens' corrected values u = (I + L)^-1 (beta v) and decayed keys
  w = (I + L)^-1 (beta exp(c) k), where L_ij = beta_i exp(c_i - c_j) k_i.k_j for
  j < i (the UT transform); each token's new value v' = u - w S; outputs
  exp(c) q S + (q k^T * decay, causal) v'; and the next chunk's state
  exp(c_last) S + (exp(c_last - c) k)^T v'. The sequence is padded with zeros
  (g = 0, beta = 0: no decay, no write) to a whole number of chunks.

  Runs (`runs`, from `segment_ids`): pairs of tokens in different runs do not
  interact, and only the tokens of the run the carried state belongs to read
  it; as runs only grow, masking those products is exact.
  """
  dtype = v.dtype
  q, k, v, g, beta, state, run = _prepare(q, k, v, g, beta, state, segment_ids)
  batch, heads, steps = v.shape[:3]
  pad = -steps % chunk_size
  q, k, v = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (q, k, v))
  g, beta = (jnp.pad(x, ((0, 0), (0, 0), (0, pad))) for x in (g, beta))
  run = jnp.pad(run, ((0, 0), (0, pad)), mode="edge")  # the padding joins the last run: it keeps its state
  chunks = (steps + pad) // chunk_size

  def split(x):  # [B, H, T, ...] -> [B, H, N, C, ...]
    return x.reshape(batch, heads, chunks, chunk_size, *x.shape[3:])

  q, k, v, g, beta = map(split, (q, k, v, g, beta))
  run = run.reshape(batch, 1, chunks, chunk_size)  # one run per token, for every head
  # The run the state entering each chunk belongs to: that of the previous chunk's last token (0 before the first).
  entering = jnp.pad(run[..., :-1, -1], ((0, 0), (0, 0), (1, 0)))[..., None]  # [B, 1, N, 1]
  reads_state = (run == entering).astype(jnp.float32)[..., None]  # [B, 1, N, C, 1]
  same_run = run[..., :, None] == run[..., None, :]
  cum = jnp.cumsum(g, axis=-1)  # [B, H, N, C]
  causal = jnp.tril(jnp.ones((chunk_size, chunk_size), bool)) & same_run
  # exp(c_i - c_j) for j <= i; the masked differences are positive and could overflow, so mask before exp.
  decay = jnp.exp(jnp.where(causal, cum[..., :, None] - cum[..., None, :], -jnp.inf))
  k_beta = k * beta[..., None]
  strictly_lower = jnp.einsum("...ik,...jk->...ij", k_beta, k) * decay * jnp.tri(chunk_size, k=-1)
  unit_lower = strictly_lower + jnp.eye(chunk_size, dtype=jnp.float32)
  solve = lambda rhs: jax.lax.linalg.triangular_solve(unit_lower, rhs, left_side=True, lower=True, unit_diagonal=True)
  corrected = solve(v * beta[..., None])  # u
  decayed_keys = solve(k_beta * jnp.exp(cum)[..., None] * reads_state)  # w
  intra = jnp.einsum("...ik,...jk->...ij", q, k) * decay
  q_decayed = q * jnp.exp(cum)[..., None] * reads_state
  in_last_run = (run == run[..., -1:]).astype(jnp.float32)[..., None]
  k_to_end = k * jnp.exp(cum[..., -1:] - cum)[..., None] * in_last_run
  chunk_decay = jnp.exp(cum[..., -1])[..., None, None] * reads_state[..., -1:, :]  # [B, H, N, 1, 1]

  def chunk(state, xs):
    corrected, decayed_keys, intra, q_decayed, k_to_end, chunk_decay = xs
    new_values = corrected - decayed_keys @ state
    out = q_decayed @ state + intra @ new_values
    state = state * chunk_decay + jnp.swapaxes(k_to_end, -1, -2) @ new_values
    return state, out

  chunk_major = [jnp.moveaxis(x, 2, 0) for x in (corrected, decayed_keys, intra, q_decayed, k_to_end, chunk_decay)]
  state, out = jax.lax.scan(chunk, state, chunk_major)  # out [N, B, H, C, V]
  out = jnp.moveaxis(out, 0, 2).reshape(batch, heads, chunks * chunk_size, -1)[:, :, :steps]
  return jnp.swapaxes(out, 1, 2).astype(dtype), state


def gated_rms_norm(x: jax.Array, gate: jax.Array, scale: jax.Array, *, epsilon: float) -> jax.Array:
  """RMSNorm of each value head's output x [..., V], times its weight `scale` [V], times silu(gate).

  transformers' Qwen3NextRMSNormGated: statistics and the gate in float32; the
  weight multiplies as it is (no 1 + w). Returns x's dtype.
  """
  x32 = x.astype(jnp.float32)
  normed = (x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + epsilon)).astype(x.dtype)
  return (normed * scale.astype(x.dtype) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)


def mixer(
    qkvz: jax.Array,
    ba: jax.Array,
    conv_kernel: jax.Array,
    a_log: jax.Array,
    dt_bias: jax.Array,
    norm_scale: jax.Array,
    segment_ids: jax.Array,
    *,
    key_dim: int,
    epsilon: float,
    chunk_size: int,
    state: jax.Array | None = None,
    window: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A Qwen3-Next linear-attention layer between its input and output projections.

  `qkvz` [B, T, Hk, 2K + 2gV] holds per key head its query, key, then its g
  value heads' values and output gates (Hugging Face's in_proj_qkvz layout);
  `ba` [B, T, Hk, 2g] per key head its value heads' b then a. q, k and v go
  through the causal convolution (from `window`) and silu; q and k are
  L2-normalised; the delta rule runs from `state` (chunked for several
  tokens, token by token for one: a decode step); each value head's output is
  RMS-normed and gated by silu(z). Returns (output [B, T, Hv, V], the state
  after, the convolution window after).
  """
  batch, steps, key_heads, _ = qkvz.shape
  groups = ba.shape[-1] // 2
  value_dim = (qkvz.shape[-1] - 2 * key_dim) // (2 * groups)
  value_heads = key_heads * groups
  q, k, v, z = jnp.split(qkvz, [key_dim, 2 * key_dim, 2 * key_dim + groups * value_dim], axis=-1)
  b, a = (x.reshape(batch, steps, value_heads) for x in jnp.split(ba, 2, axis=-1))
  flat = jnp.concatenate([q.reshape(batch, steps, -1), k.reshape(batch, steps, -1), v.reshape(batch, steps, -1)], axis=-1)
  flat, window = causal_conv1d(flat, conv_kernel, window, segment_ids)
  flat = jax.nn.silu(flat.astype(jnp.float32)).astype(qkvz.dtype)
  q, k, v = jnp.split(flat, [key_heads * key_dim, 2 * key_heads * key_dim], axis=-1)
  q, k = (l2_normalize(x.reshape(batch, steps, key_heads, key_dim)) for x in (q, k))
  v = v.reshape(batch, steps, value_heads, value_dim)
  g, beta = gating(a, b, a_log, dt_bias)
  if steps == 1 and state is not None:
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, state, segment_ids)
  else:
    out, state = chunked_gated_delta_rule(q, k, v, g, beta, state, segment_ids, chunk_size=chunk_size)
  out = gated_rms_norm(out, z.reshape(batch, steps, value_heads, value_dim), norm_scale, epsilon=epsilon)
  return out, state, window
