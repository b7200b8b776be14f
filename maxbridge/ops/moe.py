"""Mixture of experts: routing, the expert computation (dropless and dense), load balancing.

Shapes: tokens are flattened to T = batch * length; D model width, E experts,
F expert hidden width, K experts per token.
"""

from typing import Callable

import jax
import jax.numpy as jnp
from flax.nnx.nn.dtypes import promote_dtype

from maxbridge.ops.linear import DotGeneral

RaggedDot = Callable[..., jax.Array]


def lax_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, **kwargs) -> jax.Array:
  """`jax.lax.ragged_dot`, looked up when called: Qwix quantizes by swapping that attribute while the model
  runs, which a default argument bound at import would never see."""
  return jax.lax.ragged_dot(lhs, rhs, group_sizes, **kwargs)


def top_k_softmax(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Mixtral routing: the top-k logits, softmaxed among themselves -> (weights, indices) [T, K].

  Equal to a softmax over all experts renormalised over the top k (Hugging
  Face's order of operations), without computing the discarded terms.
  """
  top_logits, indices = jax.lax.top_k(logits.astype(jnp.float32), k)
  return jax.nn.softmax(top_logits, axis=-1), indices


def top_k_of_softmax(logits: jax.Array, k: int, *, normalize: bool) -> tuple[jax.Array, jax.Array]:
  """Qwen3-MoE routing: a softmax over every expert, then its top k -> (weights, indices) [T, K].

  Unlike `top_k_softmax` the weights keep their share of the whole softmax, so
  they sum to less than 1, unless `normalize` (Hugging Face's `norm_topk_prob`)
  rescales them to sum to 1, which is then `top_k_softmax`.
  """
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  weights, indices = jax.lax.top_k(probs, k)
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, indices


def group_limited_softmax(
    logits: jax.Array, k: int, *, n_groups: int, top_groups: int, normalize: bool
) -> tuple[jax.Array, jax.Array]:
  """DeepSeek-V2 routing (`topk_method: group_limited_greedy`) -> (weights, indices) [T, K].

  A softmax over every expert; the `top_groups` groups whose best expert scores
  highest are kept (V3's sigmoid routing ranks groups by their top two), then
  the top k inside them, weighted by their share of the whole softmax (as
  `top_k_of_softmax`, renormalised when `normalize`).
  """
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  tokens, experts = probs.shape
  group_scores = jnp.max(probs.reshape(tokens, n_groups, experts // n_groups), axis=-1)  # [T, G]
  _, group_indices = jax.lax.top_k(group_scores, top_groups)
  group_mask = jnp.sum(jax.nn.one_hot(group_indices, n_groups, dtype=jnp.float32), axis=-2)
  expert_mask = jnp.repeat(group_mask, experts // n_groups, axis=-1) > 0
  weights, indices = jax.lax.top_k(jnp.where(expert_mask, probs, -jnp.inf), k)
  if normalize:
    weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights, indices


def top_k_sigmoid(logits: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
  """Llama 4 routing: the top-k logits, each through a sigmoid on its own -> (weights, indices) [T, K].

  Not renormalised: with its one expert (k=1), a token's routed branch is scaled by sigmoid(logit) < 1.
  """
  top, indices = jax.lax.top_k(logits, k)
  return jax.nn.sigmoid(top.astype(jnp.float32)), indices


def group_limited_sigmoid(
    logits: jax.Array,
    correction_bias: jax.Array | None,
    k: int,
    *,
    n_groups: int,
    top_groups: int,
    scaling_factor: float,
) -> tuple[jax.Array, jax.Array]:
  """DeepSeek-V3 routing -> (weights, indices) [T, K].

  Scores are sigmoid(logits). Experts are *chosen* by score + correction bias,
  first keeping the `top_groups` groups whose two best experts score highest
  (when `n_groups` > 0), then the top k inside them; the *weights* are the
  chosen experts' plain scores, normalised to sum to 1, times `scaling_factor`.
  """
  scores = jax.nn.sigmoid(logits.astype(jnp.float32))
  choice = scores if correction_bias is None else scores + correction_bias.astype(jnp.float32)
  if n_groups > 0:
    tokens, experts = choice.shape
    grouped = choice.reshape(tokens, n_groups, experts // n_groups)
    group_scores = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # [T, G]
    _, group_indices = jax.lax.top_k(group_scores, top_groups)
    group_mask = jnp.sum(jax.nn.one_hot(group_indices, n_groups, dtype=jnp.float32), axis=-2)
    expert_mask = jnp.repeat(group_mask, experts // n_groups, axis=-1) > 0
    choice = jnp.where(expert_mask, choice, -jnp.inf)
  _, indices = jax.lax.top_k(choice, k)
  weights = jnp.take_along_axis(scores, indices, axis=-1)
  weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
  return weights * scaling_factor, indices


def load_balance_loss(probs: jax.Array, indices: jax.Array, num_experts: int) -> jax.Array:
  """Switch/Mixtral auxiliary loss: E * sum_e (fraction routed to e) * (mean router prob of e).

  probs [T, E] router probabilities; indices [T, K] chosen experts. Equals 1
  for a perfectly uniform router; the caller scales it by its weight.
  """
  routed = jnp.sum(jax.nn.one_hot(indices, num_experts, dtype=jnp.float32), axis=1)  # [T, E]
  fraction = jnp.mean(routed, axis=0) / indices.shape[-1]
  mean_prob = jnp.mean(probs.astype(jnp.float32), axis=0)
  return num_experts * jnp.sum(fraction * mean_prob)


def _promote(values: tuple, dtype: jnp.dtype) -> list:
  """flax's `promote_dtype` of the arrays; a served expert weight (quantized, frozen: not an array) passes on
  to its matmul as it is."""
  promoted = iter(promote_dtype([v for v in values if isinstance(v, jax.Array)], dtype=dtype))
  return [next(promoted) if isinstance(v, jax.Array) else v for v in values]


def _expert_mlp(x, wi_0, wi_1, wo, matmul, dtype, activation=jax.nn.silu):
  x, wi_0, wi_1, wo = _promote((x, wi_0, wi_1, wo), dtype)
  gate = matmul(x, wi_0)
  up = matmul(x, wi_1)
  return matmul(activation(gate) * up, wo)


def block_losses(values: list[dict[str, jax.Array]]) -> dict[str, jax.Array]:
  """A block of layers' per-layer values (`Stack.sublayers`): the mean of its MoE layers' load-balancing losses,
  so that the decoder's mean over blocks is the mean over MoE layers (each block holds as many)."""
  losses = [out["moe_lb_losses"] for out in values if "moe_lb_losses" in out]
  return {"moe_lb_losses": jnp.mean(jnp.stack(losses))} if losses else {}


def dropless_experts(
    x: jax.Array,
    weights: jax.Array,
    indices: jax.Array,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    *,
    dtype: jnp.dtype,
    ragged_dot: RaggedDot = lax_ragged_dot,
    weight_inputs: bool = False,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
) -> jax.Array:
  """x [T, D] through each token's K experts (SwiGLU, wi_* [E, D, F], wo [E, F, D]) -> [T, D].

  `activation` replaces SwiGLU's silu on the gate (Gemma 4's experts: GELU's tanh approximation).

  `weights` scale each expert's output, or with `weight_inputs` its input (Llama 4's).

  Dropless: every (token, expert) pair is computed, none dropped for capacity.
  Pairs are sorted by expert so that each expert's rows are contiguous, and
  `ragged_dot` (`jax.lax.ragged_dot`, or a quantized one) multiplies each
  group by its expert's kernel.
  """
  tokens, k = indices.shape
  num_experts = wi_0.shape[0]
  with jax.named_scope("dropless_experts"):
    flat_experts = indices.reshape(-1)  # [T*K], pair p = token p // K
    order = jnp.argsort(flat_experts, stable=True)
    rows = jnp.take(x, order // k, axis=0)  # [T*K, D] grouped by expert
    if weight_inputs:
      pair_weights = jnp.take(weights.reshape(-1), order)[:, None].astype(jnp.float32)
      rows = (rows.astype(jnp.float32) * pair_weights).astype(rows.dtype)
      weights = jnp.ones_like(weights)
    group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)

    def matmul(lhs, rhs):
      return ragged_dot(lhs, rhs, group_sizes)

    out = _expert_mlp(rows, wi_0, wi_1, wo, matmul, dtype, activation)  # [T*K, D]
    out = jnp.take(out, jnp.argsort(order), axis=0).reshape(tokens, k, -1)  # back to pair order
    combined = jnp.einsum("TKD,TK->TD", out.astype(jnp.float32), weights.astype(jnp.float32))
    return combined.astype(dtype)


def dense_experts(
    x: jax.Array,
    weights: jax.Array,
    indices: jax.Array,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    *,
    dtype: jnp.dtype,
    dot_general: DotGeneral = jax.lax.dot_general,
    weight_inputs: bool = False,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
) -> jax.Array:
  """The reference path: every token through every expert, unchosen ones weighted 0 -> [T, D].

  With `weight_inputs` the weights scale each expert's input (Llama 4's), and an
  unchosen expert's zero input gives it a zero output.
  """
  num_experts = wi_0.shape[0]
  with jax.named_scope("dense_experts"):

    def matmul(lhs, rhs):
      if lhs.ndim == 2:  # TD,EDF->TEF
        return dot_general(lhs, rhs, (((1,), (1,)), ((), ())))
      # TEF,EFD->TED (and TED,EDF->TEF): experts are a batch axis, which dot_general puts first.
      return jnp.swapaxes(dot_general(lhs, rhs, (((2,), (1,)), ((1,), (0,)))), 0, 1)

    combine = jnp.einsum(
        "TKE,TK->TE", jax.nn.one_hot(indices, num_experts, dtype=jnp.float32), weights.astype(jnp.float32)
    )
    if weight_inputs:
      inputs = (x.astype(jnp.float32)[:, None, :] * combine[:, :, None]).astype(x.dtype)  # [T, E, D]
      out = _expert_mlp(inputs, wi_0, wi_1, wo, matmul, dtype, activation)
      return jnp.sum(out.astype(jnp.float32), axis=1).astype(dtype)
    out = _expert_mlp(x, wi_0, wi_1, wo, matmul, dtype, activation)  # [T, E, D]
    return jnp.einsum("TED,TE->TD", out.astype(jnp.float32), combine).astype(dtype)


def routed_moe(
    x: jax.Array,
    logits: jax.Array,
    correction_bias: jax.Array | None,
    wi_0: jax.Array,
    wi_1: jax.Array,
    wo: jax.Array,
    *,
    num_experts_per_tok: int,
    score_func: str = "",
    n_groups: int = -1,
    top_groups: int = -1,
    scaling_factor: float = 1.0,
    norm_topk_prob: bool = False,
    sparse: bool = True,
    load_balance_loss_weight: float = 0.0,
    dtype: jnp.dtype = jnp.float32,
    dot_general: DotGeneral = jax.lax.dot_general,
    ragged_dot: RaggedDot = lax_ragged_dot,
) -> tuple[jax.Array, jax.Array | None]:
  """x [B, T, D], router logits [B, T, E] -> (routed experts' output [B, T, D], weighted aux loss or None).

  `score_func` "" routes Mixtral's way (softmax over the top-k logits),
  "softmax" Qwen3-MoE's (`top_k_of_softmax`, renormalised when
  `norm_topk_prob`; DeepSeek-V2's `group_limited_softmax` where `n_groups` > 0),
  "sigmoid" DeepSeek-V3's (`group_limited_sigmoid`), "topk_sigmoid"
  Llama 4's (`top_k_sigmoid`: each chosen expert's score scales its input). `sparse` picks the
  dropless grouped matmul, else the dense reference path; both compute the
  same function; the expert matmuls go through `ragged_dot` or `dot_general`
  respectively (the router's is the caller's). The load-balancing loss is
  computed only when its weight is > 0.
  """
  batch, length, width = x.shape
  num_experts = logits.shape[-1]
  flat_x = x.reshape(batch * length, width)
  flat_logits = logits.reshape(batch * length, num_experts)
  with jax.named_scope("routing"):
    if score_func == "sigmoid":
      weights, indices = group_limited_sigmoid(
          flat_logits,
          correction_bias,
          num_experts_per_tok,
          n_groups=n_groups,
          top_groups=top_groups,
          scaling_factor=scaling_factor,
      )
    elif score_func == "topk_sigmoid":
      weights, indices = top_k_sigmoid(flat_logits, num_experts_per_tok)
    elif score_func in ("", "softmax"):
      if correction_bias is not None:
        raise ValueError("a router correction bias needs score_func='sigmoid'")
      if score_func and n_groups > 0:
        weights, indices = group_limited_softmax(
            flat_logits, num_experts_per_tok, n_groups=n_groups, top_groups=top_groups, normalize=norm_topk_prob
        )
      elif score_func:
        weights, indices = top_k_of_softmax(flat_logits, num_experts_per_tok, normalize=norm_topk_prob)
      else:
        weights, indices = top_k_softmax(flat_logits, num_experts_per_tok)
      weights = weights * scaling_factor if scaling_factor != 1.0 else weights
    else:
      raise ValueError(f"unknown router score_func {score_func!r}; valid: '', 'softmax', 'sigmoid', 'topk_sigmoid'")
  weight_inputs = score_func == "topk_sigmoid"
  if sparse:
    out = dropless_experts(
        flat_x, weights, indices, wi_0, wi_1, wo, dtype=dtype, ragged_dot=ragged_dot, weight_inputs=weight_inputs
    )
  else:
    out = dense_experts(
        flat_x, weights, indices, wi_0, wi_1, wo, dtype=dtype, dot_general=dot_general, weight_inputs=weight_inputs
    )
  out = out.reshape(batch, length, width)
  aux = None
  if load_balance_loss_weight > 0:
    scores = flat_logits.astype(jnp.float32)
    if score_func in ("sigmoid", "topk_sigmoid"):
      scores = jax.nn.sigmoid(scores)
      probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
      probs = jax.nn.softmax(scores, axis=-1)
    aux = load_balance_loss_weight * load_balance_loss(probs, indices, num_experts)
  return out, aux


def moe_options(config) -> dict:
  """The config's routing settings, as `routed_moe` takes them."""
  return dict(
      num_experts_per_tok=config.num_experts_per_tok,
      score_func=config.family.routing or config.routed_score_func,  # Llama 4's is its family's, not a key's
      n_groups=config.n_routing_groups,
      top_groups=config.topk_routing_group,
      scaling_factor=config.routed_scaling_factor,
      norm_topk_prob=config.norm_topk_prob,
      sparse=config.sparse_matmul,
      load_balance_loss_weight=config.load_balance_loss_weight,
      dtype=jnp.dtype(config.dtype),
  )


def biased_experts(
    x: jax.Array,
    weights: jax.Array,
    indices: jax.Array,
    wi: jax.Array,
    wi_bias: jax.Array,
    wo: jax.Array,
    wo_bias: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array],
    dtype: jnp.dtype,
    sparse: bool = True,
    dot_general: DotGeneral = jax.lax.dot_general,
    ragged_dot: RaggedDot = lax_ragged_dot,
) -> jax.Array:
  """x [T, D] through each token's K experts with biases -> [T, D] (gpt-oss).

  Each expert is wo(activation(x wi + wi_bias)) + wo_bias with one fused input
  kernel wi [E, D, H] (`activation` maps H to wo's F), wi_bias [E, H], wo [E, F, D],
  wo_bias [E, D]. `sparse`: dropless grouped matmuls (`ragged_dot`), as
  `dropless_experts`; else every token through every expert, as `dense_experts`.
  """
  tokens, k = indices.shape
  num_experts = wi.shape[0]
  x, wi, wi_bias, wo, wo_bias = _promote((x, wi, wi_bias, wo, wo_bias), dtype)
  if sparse:
    with jax.named_scope("dropless_experts"):
      flat_experts = indices.reshape(-1)
      order = jnp.argsort(flat_experts, stable=True)
      rows = jnp.take(x, order // k, axis=0)
      row_experts = jnp.take(flat_experts, order)
      group_sizes = jnp.bincount(flat_experts, length=num_experts).astype(jnp.int32)
      hidden = ragged_dot(rows, wi, group_sizes) + jnp.take(wi_bias, row_experts, axis=0)
      out = ragged_dot(activation(hidden), wo, group_sizes) + jnp.take(wo_bias, row_experts, axis=0)
      out = jnp.take(out, jnp.argsort(order), axis=0).reshape(tokens, k, -1)
      combined = jnp.einsum("TKD,TK->TD", out.astype(jnp.float32), weights.astype(jnp.float32))
      return combined.astype(dtype)
  with jax.named_scope("dense_experts"):
    hidden = dot_general(x, wi, (((1,), (1,)), ((), ()))) + wi_bias  # TD,EDH->TEH
    out = jnp.swapaxes(dot_general(activation(hidden), wo, (((2,), (1,)), ((1,), (0,)))), 0, 1) + wo_bias
    combine = jnp.einsum(
        "TKE,TK->TE", jax.nn.one_hot(indices, num_experts, dtype=jnp.float32), weights.astype(jnp.float32)
    )
    return jnp.einsum("TED,TE->TD", out.astype(jnp.float32), combine).astype(dtype)


def biased_routed_moe(
    x: jax.Array,
    logits: jax.Array,
    wi: jax.Array,
    wi_bias: jax.Array,
    wo: jax.Array,
    wo_bias: jax.Array,
    *,
    activation: Callable[[jax.Array], jax.Array],
    num_experts_per_tok: int,
    sparse: bool = True,
    load_balance_loss_weight: float = 0.0,
    dtype: jnp.dtype = jnp.float32,
    dot_general: DotGeneral = jax.lax.dot_general,
    ragged_dot: RaggedDot = lax_ragged_dot,
) -> tuple[jax.Array, jax.Array | None]:
  """x [B, T, D], router logits [B, T, E] (bias included) -> (output [B, T, D], weighted aux loss or None).

  Routing is Mixtral's (`top_k_softmax`); the experts are `biased_experts`.
  """
  batch, length, width = x.shape
  num_experts = logits.shape[-1]
  flat_logits = logits.reshape(batch * length, num_experts)
  with jax.named_scope("routing"):
    weights, indices = top_k_softmax(flat_logits, num_experts_per_tok)
  out = biased_experts(
      x.reshape(batch * length, width),
      weights,
      indices,
      wi,
      wi_bias,
      wo,
      wo_bias,
      activation=activation,
      dtype=dtype,
      sparse=sparse,
      dot_general=dot_general,
      ragged_dot=ragged_dot,
  ).reshape(batch, length, width)
  aux = None
  if load_balance_loss_weight > 0:
    probs = jax.nn.softmax(flat_logits.astype(jnp.float32), axis=-1)
    aux = load_balance_loss_weight * load_balance_loss(probs, indices, num_experts)
  return out, aux
