"""Every decoder family agrees with Linen: scanned, pure NNX and the bridged mixes that put each kind of bridge
around its layers; unscanned as pure NNX (x remat: one family per stack shape).

The bridged mixes wrap a whole stack (ToLinen / ToNNX) whatever its layers, and
tests/test_parity.py runs all 8 unscanned on llama; a family's own layers meet
each bridge in its scanned form, MaxText's default.

The matrix is cheap by construction. Each (family, scan, remat) setting runs the
pure-Linen reference and pure NNX through one jitted value_and_grad each
(identical lowered programs share one compiled executable). A bridged mix runs
one of the two decoders (`pure_nnx_decoder`); when its traced forward pass (the
jaxpr and its constants) is the one already compared for that decoder, on
bit-equal parameters, its logits and gradients are those numbers too (jax
differentiates the traced program), so only a mix that traces to a program of
its own is differentiated, compiled and compared. Each setting's parameters
are drawn once, unscanned, and stacked for the scanned rows (the stacking is
checked below and in test_parity.py).
"""

import contextlib
import functools
import hashlib

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import maxbridge as mb
from maxbridge.core import canonical, initializers
from maxbridge.models import dispatch
from maxbridge.ops import attention, losses
from maxbridge.ops import moe as moe_ops
from conftest import FLAG_COMBINATIONS, flag_id

TOL = 1e-6
FAMILIES = [
    "mistral-tiny",
    "qwen3-tiny",
    "gpt3-tiny",
    "mixtral-tiny",
    "deepseek3-tiny",
    "olmo2-tiny",
    "olmo3-tiny",
    "qwen3-moe-tiny",
    "gemma-tiny",
    "gemma2-tiny",
    "gemma3-tiny",
    "gpt-oss-tiny",
    "qwen3-next-tiny",
    "llama4-tiny",
    "gemma4-tiny",
    "qwen2.5-tiny",
    "glm4.5-tiny",
    "deepseek2-tiny",
    "deepseek3.2-tiny",  # its lightning indexer keeps 4 of the 12 tokens' keys
    "qwen3.5-tiny",  # its dense MLP; qwen3.5-moe-tiny runs qwen3-next-tiny's layer code
]
TOKENS = jax.random.randint(jax.random.key(1), (2, 12), 0, 256)
_EXECUTABLES: dict[str, object] = {}


def family_config(preset, flags=(False, False, False), **overrides) -> mb.Config:
  pure_nnx, enable_nnx, pure_nnx_decoder = flags
  return mb.load_config(preset, pure_nnx=pure_nnx, enable_nnx=enable_nnx, pure_nnx_decoder=pure_nnx_decoder, **overrides)


def logits_and_grads(model: mb.Model, tokens=TOKENS):
  """One jitted value_and_grad; an identical lowered program reuses its compiled executable."""

  def loss(params):
    logits = model.apply(params, tokens)
    per_token, _ = losses.cross_entropy_with_z_loss(logits[:, :-1], tokens[:, 1:], z_loss_multiplier=1e-4)
    return jnp.mean(per_token), logits

  params = model.params()
  lowered = jax.jit(jax.value_and_grad(loss, has_aux=True)).lower(params)
  key = hashlib.sha256(lowered.as_text(debug_info=False).encode()).hexdigest()
  if key not in _EXECUTABLES:
    _EXECUTABLES[key] = lowered.compile()
  (_, logits), grads = _EXECUTABLES[key](params)
  return logits, grads


def tree_differences(got, want, tol, relative=False) -> list[str]:
  """`relative`: each leaf within tol x max(1, its largest |value|), float32's resolution for leaves past 1."""
  got, want = canonical.flatten(got), canonical.flatten(want)
  if sorted(got) != sorted(want):
    return [f"paths differ: {sorted(set(got) ^ set(want))}"]
  problems = []
  for path in want:
    if got[path].shape != want[path].shape:
      problems.append(f"{path}: shape {got[path].shape} != {want[path].shape}")
      continue
    diff = float(np.max(np.abs(np.asarray(got[path], np.float64) - np.asarray(want[path], np.float64))))
    bound = tol * max(1.0, float(np.max(np.abs(want[path])))) if relative else tol
    if not diff <= bound:
      problems.append(f"{path}: max abs diff {diff} > {bound}")
  return problems


# Remat wraps whatever a stack holds, so it is checked on one family of each stack shape (llama's
# in test_parity.py, every flag combination with and without it): one scanned kind with experts, two
# stacks, a repeating block of sub-layers. Those three run only with it: remat changes how a layer is
# differentiated, not what it computes, so their rows without it would check their layers again, and
# the path without remat is every other family's.
REMAT_FAMILIES = ["mixtral-tiny", "deepseek3-tiny", "gemma2-tiny"]
MATRIX = [(preset, "full" if preset in REMAT_FAMILIES else "none") for preset in FAMILIES]


@functools.lru_cache(maxsize=None)
def unscanned_initial_params(preset: str) -> dict:
  """Seed 0's unscanned parameters of `preset`, drawn (compiled) once for all its rows."""
  return mb.create_model(family_config(preset, scan_layers=False), seed=0).params()


def matrix_model(preset: str, flags, scan_layers: bool, remat_policy: str) -> mb.Model:
  """Unscanned: the model for seed 0. Scanned: the same parameters, stacked (as seed 0 draws them)."""
  config = family_config(preset, flags, scan_layers=scan_layers, remat_policy=remat_policy)
  if not scan_layers:
    return mb.create_model(config, seed=0)
  stacked = canonical.stack_layers(unscanned_initial_params(preset), config.param_scan_axis)
  return mb.create_model(config, params=stacked)


def forward_program(model: mb.Model) -> str:
  """A digest of the model's traced forward pass on TOKENS: its jaxpr and the values of the constants it reads."""
  closed = jax.make_jaxpr(lambda params: model.apply(params, TOKENS))(model.params())
  digest = hashlib.sha256(str(closed.jaxpr).encode())
  for const in closed.consts:
    if jax.dtypes.issubdtype(getattr(const, "dtype", None), jax.dtypes.prng_key):
      const = jax.random.key_data(const)
    const = np.asarray(const)
    digest.update(f"{const.dtype}{const.shape}".encode() + const.tobytes())
  return digest.hexdigest()


# The bridges a mixed combination (pure_nnx, enable_nnx, pure_nnx_decoder) puts around a family's layers
# (models/dispatch.py): ToLinen around the NNX decoder (0,0,1), (1,0,1); ToNNX around the Linen decoder (0,1,0),
# (1,1,0); ToLinen around the NNX model (0,1,0), (0,1,1); ToNNX around the Linen model (1,0,0), (1,0,1).
# (1,0,1) and (0,1,0) between them put all four around every family, each nested in the other kind. The other
# four combinations hold only bridges those two hold; they take turns over the families, so each still runs on
# three or four families, and all eight on llama (tests/test_parity.py).
COVERING_MIXES = [(True, False, True), (False, True, False)]
TURNS = [(False, False, True), (False, True, True), (True, False, False), (True, True, False)]


def bridged_mixes(preset: str) -> list[tuple[bool, bool, bool]]:
  return [*COVERING_MIXES, TURNS[FAMILIES.index(preset) % len(TURNS)]]


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unscanned"])
@pytest.mark.parametrize("preset, remat_policy", MATRIX)
def test_every_flag_combination_matches_pure_linen(preset, scan_layers, remat_policy):
  setting = dict(scan_layers=scan_layers, remat_policy=remat_policy)
  reference = matrix_model(preset, FLAG_COMBINATIONS[0], **setting)
  ref_logits, ref_grads = logits_and_grads(reference)
  assert ref_logits.shape == (*TOKENS.shape, reference.config.vocab_size)
  assert np.all(np.isfinite(ref_logits))
  # Per decoder backend (pure_nnx_decoder), the forward program whose logits and gradients matched the reference's.
  compared = {False: forward_program(reference)} if scan_layers else {}
  pure_nnx = (True, True, True)  # compared first: the bridged mixes of its decoder then trace to its program
  mixes = bridged_mixes(preset) if scan_layers else []
  failures = []
  for flags in [pure_nnx, *mixes]:
    model = matrix_model(preset, flags, **setting)
    problems = []
    if model.abstract_params() != reference.abstract_params():
      problems.append("abstract parameter trees differ")
    if canonical.flatten(model.logical_axes()) != canonical.flatten(reference.logical_axes()):
      problems.append("logical axes differ")
    problems += [f"initial {p}" for p in tree_differences(model.params(), reference.params(), 0.0)]
    if problems or flags[2] not in compared or forward_program(model) != compared[flags[2]]:
      logits, grads = logits_and_grads(model)
      problems += [f"logits {p}" for p in tree_differences({"logits": logits}, {"logits": ref_logits}, TOL)]
      # Relative: the backends sum a gradient's terms in their own order, and Qwen3-Next's first DeltaNet layer
      # has gradients near 20 (through the L2-normalised queries and keys), where 1e-6 is a few float32 ulps.
      problems += [f"grads {p}" for p in tree_differences(grads, ref_grads, TOL, relative=True)]
      if scan_layers and not problems:
        compared.setdefault(flags[2], forward_program(model))
    failures += [f"{flag_id(flags)}: {p}" for p in problems]
  assert not failures, f"{preset} {setting}:\n" + "\n".join(failures)


# Stacking is generic (tests/test_parity.py covers it for llama); these add expert
# arrays, DeepSeek's two stacks, and parameters outside the stacks (positions).
@pytest.mark.parametrize("preset", ["gpt3-tiny", "mixtral-tiny", "deepseek3-tiny"])
def test_scanned_parameters_are_the_unscanned_layers_stacked(preset):
  scanned = mb.create_model(family_config(preset, (True, True, True), scan_layers=True), seed=3)
  unscanned = mb.create_model(family_config(preset, scan_layers=False), seed=3)
  stacked = canonical.stack_layers(unscanned.params(), scanned.config.param_scan_axis)
  assert not tree_differences(stacked, scanned.params(), 0.0)
  np.testing.assert_allclose(scanned.logits(TOKENS), unscanned.logits(TOKENS), atol=TOL, rtol=0)


@pytest.mark.parametrize("preset, scan_layers", [("deepseek3-tiny", True), ("qwen3-next-tiny", False)])
def test_drawing_a_leaf_at_a_time_gives_the_whole_tree_draw_bit_for_bit(preset, scan_layers):
  # create_model draws leaf by leaf (initializers.jitted_init); init_params traced as one program is the definition.
  # DeepSeek: two stacks of scanned layers, experts; Qwen3-Next: zero-centred norms, the DeltaNet's own rules.
  config = family_config(preset, scan_layers=scan_layers)
  model = mb.create_model(config, seed=3)
  options = initializers.InitOptions.from_config(config)
  whole = jax.jit(lambda seed: initializers.init_params(model.abstract_params(), seed, options))(3)
  assert not tree_differences(model.params(), whole, 0.0)


def test_sliding_window_mask_sees_the_last_w_positions_of_its_segment():
  segments = jnp.array([[1, 1, 1, 1, 1, 2, 2, 2]])
  indices = jnp.arange(8)[None]  # positions that do not restart per segment: the loop below is by index
  mask = np.asarray(attention.attention_mask(segments, segments, indices, indices, sliding_window_size=3))[0, 0, 0]
  for i in range(8):
    for j in range(8):
      want = j <= i and i - j < 3 and segments[0, i] == segments[0, j]
      assert mask[i, j] == want, (i, j)
  full = np.asarray(attention.attention_mask(segments, segments, indices, indices))[0, 0, 0]
  np.testing.assert_array_equal(
      full, np.asarray(attention.attention_mask(segments, segments, indices, indices, 8))[0, 0, 0]
  )


def test_mistral_is_llama_when_the_window_covers_the_sequence():
  llama = mb.create_model(family_config("llama-tiny"), seed=0)
  wide = mb.create_model(family_config("mistral-tiny", sliding_window_size=TOKENS.shape[1]), seed=0)
  narrow = mb.create_model(family_config("mistral-tiny", sliding_window_size=4), seed=0)
  assert not tree_differences(wide.params(), llama.params(), 0.0)
  np.testing.assert_array_equal(wide.logits(TOKENS), llama.logits(TOKENS))
  got, want = narrow.logits(TOKENS), llama.logits(TOKENS)
  np.testing.assert_array_equal(got[:, :4], want[:, :4])  # the window is not yet full there
  assert not np.allclose(got[:, 4:], want[:, 4:])


def test_qwen3_normalises_each_query_and_key_head():
  model = mb.create_model(family_config("qwen3-tiny", scan_layers=False), seed=0)
  attn = model.params()["decoder"]["layers_0"]["self_attention"]
  assert attn["query_norm"]["scale"].shape == (16,) and attn["key_norm"]["scale"].shape == (16,)
  # The per-head norm makes attention blind to the scale of the query kernel.
  before = model.logits(TOKENS)
  params = model.params()
  params["decoder"]["layers_0"]["self_attention"]["query"]["kernel"] *= 3.0
  np.testing.assert_allclose(model.apply(params, TOKENS), before, atol=1e-4)


def test_gpt3_learns_positions_and_ties_its_head():
  model = mb.create_model(family_config("gpt3-tiny"), seed=0)
  params = model.params()
  assert params["decoder"]["position_embedder"]["embedding"].shape == (64, 64)
  assert "logits_dense" not in params["decoder"]
  # Learned positions: shifting the positions changes the logits (RoPE-free otherwise).
  shifted = model.logits(TOKENS, positions=jnp.broadcast_to(jnp.arange(12) + 3, TOKENS.shape))
  assert not np.allclose(shifted, model.logits(TOKENS))
  with pytest.raises(ValueError, match="exceeds trainable_position_size=64"):
    model.generate(TOKENS, max_new_tokens=60)


def test_greedy_generate_is_the_argmax_of_a_full_recompute():
  model = mb.create_model(family_config("gpt3-tiny"), seed=1)
  prompt = TOKENS[:, :5]
  out = np.asarray(model.generate(prompt, max_new_tokens=4))
  assert out.shape == (2, 9) and out.dtype == np.int32
  np.testing.assert_array_equal(out[:, :5], prompt)
  # Causal: the logits of the finished sequence at t are those the loop saw at t.
  logits = np.asarray(model.logits(out))
  np.testing.assert_array_equal(out[:, 5:], np.argmax(logits[:, 4:8], axis=-1))
  sampled = [np.asarray(model.generate(prompt, 4, temperature=1.0, seed=s)) for s in (0, 0, 1)]
  np.testing.assert_array_equal(sampled[0], sampled[1])
  np.testing.assert_array_equal(sampled[2][:, :5], prompt)


def test_generate_rejects_bad_arguments():
  model = mb.create_model(family_config("qwen3-tiny"), seed=0)
  with pytest.raises(ValueError, match="prompt must be int"):
    model.generate(jnp.zeros((1, 3)), 2)
  with pytest.raises(ValueError, match="at least one token"):
    model.generate(jnp.zeros((1, 0), jnp.int32), 2)
  with pytest.raises(ValueError, match="temperature must be >= 0"):
    model.generate(TOKENS, 2, temperature=-1.0)


# --- mixture of experts ----------------------------------------------------------------------

rng = np.random.default_rng(0)


def test_top_k_softmax_is_softmax_over_all_then_renormalised_top_k():
  logits = rng.normal(size=(6, 8)).astype(np.float32)
  weights, indices = moe_ops.top_k_softmax(jnp.asarray(logits), 3)
  probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
  want_indices = np.argsort(-probs, axis=-1)[:, :3]
  want = np.take_along_axis(probs, want_indices, -1)
  np.testing.assert_array_equal(indices, want_indices)
  np.testing.assert_allclose(weights, want / want.sum(-1, keepdims=True), rtol=1e-5)


def test_dropless_experts_match_a_per_token_loop():
  tokens, width, hidden, experts, k = 10, 8, 6, 4, 2
  x = rng.normal(size=(tokens, width)).astype(np.float32)
  wi_0, wi_1 = (rng.normal(size=(experts, width, hidden)).astype(np.float32) for _ in range(2))
  wo = rng.normal(size=(experts, hidden, width)).astype(np.float32)
  indices = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)])
  indices[:4] = [0, 1]  # an uneven load: expert 3 may get few tokens, some none
  weights = rng.uniform(size=(tokens, k)).astype(np.float32)
  want = np.zeros_like(x)
  for t in range(tokens):
    for j, e in enumerate(indices[t]):
      gate, up = x[t] @ wi_0[e], x[t] @ wi_1[e]
      want[t] += weights[t, j] * ((gate / (1 + np.exp(-gate)) * up) @ wo[e])
  for experts_fn in (moe_ops.dropless_experts, moe_ops.dense_experts):
    got = experts_fn(x, weights, jnp.asarray(indices), wi_0, wi_1, wo, dtype=jnp.float32)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4, err_msg=experts_fn.__name__)


def test_load_balance_loss_is_one_when_balanced_and_grows_when_skewed():
  experts, tokens = 4, 8
  uniform = jnp.full((tokens, experts), 1 / experts)
  balanced = jnp.asarray(np.arange(tokens * 2).reshape(tokens, 2) % experts)
  assert float(moe_ops.load_balance_loss(uniform, balanced, experts)) == pytest.approx(1.0)
  skewed_probs = jnp.asarray(np.tile([0.7, 0.1, 0.1, 0.1], (tokens, 1)))
  skewed = jnp.zeros((tokens, 2), jnp.int32).at[:, 1].set(1)
  assert float(moe_ops.load_balance_loss(skewed_probs, skewed, experts)) > 1.5


def test_dropless_and_dense_paths_give_the_same_logits_and_grads():
  sparse = mb.create_model(family_config("mixtral-tiny"), seed=0)
  dense = mb.create_model(family_config("mixtral-tiny", sparse_matmul=False), seed=0)
  sparse_logits, sparse_grads = logits_and_grads(sparse)
  dense_logits, dense_grads = logits_and_grads(dense)
  np.testing.assert_allclose(sparse_logits, dense_logits, atol=1e-5, rtol=0)
  assert not tree_differences(sparse_grads, dense_grads, 1e-5)


def test_load_balancing_loss_is_sown_the_same_by_every_backend_and_trains_the_router():
  losses_by_flags = {}
  for flags in [(False, False, False), (True, True, True), (False, True, False), (True, False, True)]:
    model = mb.create_model(family_config("mixtral-tiny", flags, scan_layers=flags[2]), seed=0)

    def aux(params):
      return model.apply_with_intermediates(params, TOKENS)[1]["decoder/moe_lb_loss"]

    loss, grads = jax.jit(jax.value_and_grad(aux))(model.params())
    losses_by_flags[flags] = float(loss)
    # Differentiable: training can add it to the loss and move the router with it.
    router = "decoder/layers/MoeBlock_0/gate/kernel" if flags[2] else "decoder/layers_0/MoeBlock_0/gate/kernel"
    assert float(jnp.abs(canonical.flatten(grads)[router]).max()) > 0
  first = next(iter(losses_by_flags.values()))
  assert 0 < first < 1 and all(abs(v - first) < 1e-7 for v in losses_by_flags.values()), losses_by_flags
  off = mb.create_model(family_config("mixtral-tiny", load_balance_loss_weight=0.0), seed=0)
  _, intermediates = jax.jit(off.apply_with_intermediates)(off.params(), TOKENS)
  assert "decoder/moe_lb_loss" not in intermediates


# --- DeepSeek-V3 -----------------------------------------------------------------------------


def _deepseek_routing_reference(logits, bias, k, groups, top_groups, scale):
  """Hugging Face's DeepseekV3TopkRouter, in numpy."""
  scores = 1 / (1 + np.exp(-logits))
  choice = scores + bias
  tokens, experts = choice.shape
  grouped = np.sort(choice.reshape(tokens, groups, -1), axis=-1)[..., -2:].sum(-1)
  keep = np.argsort(-grouped, axis=-1)[:, :top_groups]
  mask = np.zeros((tokens, groups), bool)
  np.put_along_axis(mask, keep, True, axis=-1)
  choice = np.where(np.repeat(mask, experts // groups, axis=-1), choice, -np.inf)
  indices = np.argsort(-choice, axis=-1)[:, :k]
  weights = np.take_along_axis(scores, indices, -1)
  return weights / weights.sum(-1, keepdims=True) * scale, indices


def test_group_limited_sigmoid_routing_matches_deepseek():
  logits = rng.normal(size=(16, 8)).astype(np.float32)
  bias = rng.normal(size=(8,)).astype(np.float32)
  weights, indices = moe_ops.group_limited_sigmoid(
      jnp.asarray(logits), jnp.asarray(bias), 2, n_groups=4, top_groups=2, scaling_factor=2.5
  )
  want_weights, want_indices = _deepseek_routing_reference(logits, bias, 2, 4, 2, 2.5)
  np.testing.assert_array_equal(np.sort(indices, -1), np.sort(want_indices, -1))
  order, want_order = np.argsort(indices, -1), np.argsort(want_indices, -1)
  np.testing.assert_allclose(
      np.take_along_axis(np.asarray(weights), order, -1),
      np.take_along_axis(want_weights, want_order, -1),
      rtol=1e-5,
  )
  # The correction bias picks experts but never weights them.
  _, unbiased = moe_ops.group_limited_sigmoid(jnp.asarray(logits), None, 2, n_groups=4, top_groups=2, scaling_factor=2.5)
  assert not np.array_equal(np.sort(unbiased, -1), np.sort(indices, -1))


def test_deepseek_has_dense_then_moe_stacks_and_latent_attention():
  scanned = canonical.flatten(dispatch.abstract_model(family_config("deepseek3-tiny")).abstract_params())
  layer = lambda stack, rest: scanned[f"decoder/{stack}/{rest}"].shape  # noqa: E731
  assert layer("dense_layers", "mlp/wi_0/kernel") == (64, 1, 128)
  assert layer("moe_layers", "DeepSeekMoeBlock_0/MoeBlock_0/wi_0") == (8, 1, 64, 32)
  assert layer("moe_layers", "DeepSeekMoeBlock_0/MoeBlock_0/gate/bias") == (8, 1)  # layers on axis 1
  assert layer("moe_layers", "DeepSeekMoeBlock_0/shared_experts/wi_0/kernel") == (64, 1, 32)
  assert layer("moe_layers", "self_attention/wq_b/kernel") == (32, 1, 4, 16)  # [rank, L, heads, nope + rope]
  assert layer("moe_layers", "self_attention/wkv_b/kernel") == (16, 1, 4, 20)  # [rank, L, heads, nope + v]
  assert layer("moe_layers", "self_attention/out/kernel") == (4, 1, 12, 64)
  assert not any("/layers/" in path for path in scanned)
  no_lora = canonical.flatten(
      dispatch.abstract_model(family_config("deepseek3-tiny", q_lora_rank=0, scan_layers=False)).abstract_params()
  )
  assert no_lora["decoder/dense_layers_0/self_attention/query/kernel"].shape == (64, 4, 16)
  assert not any("wq_a" in path for path in no_lora)


@pytest.mark.parametrize(
    "override, match",
    [
        (dict(n_routing_groups=3), "n_routing_groups=3 must split num_experts=8"),
        (dict(topk_routing_group=-1), "set both, or both to -1"),
        (dict(first_num_dense_layers=3), "first_num_dense_layers=3 exceeds base_num_decoder_layers=2"),
        (dict(base_num_kv_heads=2), "base_num_kv_heads=2 must equal base_num_query_heads=4"),
        (dict(num_experts_per_tok=9), "num_experts_per_tok=9 must be at most num_experts=8"),
        (dict(routed_score_func="tanh"), "'routed_score_func' = 'tanh' is invalid"),
    ],
)
def test_bad_family_settings_name_the_keys(override, match):
  with pytest.raises(mb.ConfigError, match=match):
    family_config("deepseek3-tiny", **override)


class CountingMatmuls:
  """jax.lax.dot_general and ragged_dot that record each weight (right-hand operand) shape."""

  def __init__(self):
    self.weights = []

  def dot_general(self, lhs, rhs, dimension_numbers, **kwargs):
    self.weights.append(tuple(rhs.shape))
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, **kwargs)

  def ragged_dot(self, lhs, rhs, group_sizes, **kwargs):
    self.weights.append(tuple(rhs.shape))
    return jax.lax.ragged_dot(lhs, rhs, group_sizes, **kwargs)


def inject_matmuls(model: mb.Model, matmuls: CountingMatmuls):
  """Gives every module that owns a weight matmul (a `dot_general`/`ragged_dot` attribute) the counting ones."""
  seams = ("dot_general", "ragged_dot")
  if isinstance(model.module, nnx.Module):
    for _, node in nnx.iter_graph(model.module):
      for seam in seams:
        if isinstance(node, nnx.Module) and hasattr(node, seam):
          setattr(node, seam, getattr(matmuls, seam))
    return contextlib.nullcontext()

  def interceptor(next_fun, args, kwargs, context):
    module = context.module
    swap = {  # a None seam is the config's matmul, which the counting one replaces too
        seam: getattr(matmuls, seam)
        for seam in seams
        if hasattr(module, seam) and getattr(module, seam) != getattr(matmuls, seam)
    }
    if context.method_name != "__call__" or not swap:
      return next_fun(*args, **kwargs)
    # A Linen module's attributes are fixed by its parent; a clone bound to the
    # same scope (the same parameters) takes the counting matmuls instead.
    return module.clone(parent=module.scope, **swap)(*args, **kwargs)

  return nn.intercept_methods(interceptor)


@pytest.mark.parametrize("backend", ["linen", "nnx"])
@pytest.mark.parametrize(
    "preset, overrides",
    [
        ("llama-tiny", {}),
        ("gpt3-tiny", {}),  # biases and the tied head
        ("mixtral-tiny", {}),  # dropless experts: ragged_dot
        ("mixtral-tiny", {"sparse_matmul": False}),
        ("deepseek3-tiny", {}),
        ("deepseek3-tiny", {"q_lora_rank": 0}),
        ("olmo3-tiny", {}),  # OLMo 2's layers, in blocks
        ("qwen3-moe-tiny", {}),
        ("gpt-oss-tiny", {}),  # biased router and experts
    ],
    ids=["llama", "gpt3", "mixtral", "mixtral-dense", "deepseek", "deepseek-no-q-lora", "olmo3", "qwen3-moe", "gpt-oss"],
)
def test_every_weight_matmul_goes_through_the_injected_dot_general(preset, overrides, backend):
  flags = (True, True, True) if backend == "nnx" else (False, False, False)
  model = mb.create_model(family_config(preset, flags, scan_layers=False, **overrides), seed=0)
  want = model.logits(TOKENS)
  matmuls = CountingMatmuls()
  with inject_matmuls(model, matmuls):
    got = jax.jit(lambda params: model.apply(params, TOKENS))(model.params())  # counted once, while tracing
  np.testing.assert_array_equal(got, want)
  # One matmul per weight matrix: every parameter but biases, norm scales, attention sinks and
  # lookup tables (the token embedding is a weight matrix too when it is the head).
  lookups = ("decoder/position_embedder/embedding",)
  if not model.config.logits_via_embedding:
    lookups += ("token_embedder/embedding",)
  weights = [
      tuple(leaf.shape)
      for path, leaf in canonical.flatten(model.params()).items()
      if not path.endswith("bias") and path.rsplit("/", 1)[-1] not in ("scale", "sinks") and path not in lookups
  ]
  assert sorted(matmuls.weights) == sorted(weights)


def test_query_kernel_carries_the_scale_only_where_attention_does_not_apply_it():
  carries = {
      preset: initializers.query_kernel_carries_scale(family_config(preset)) for preset in ["llama-tiny", *FAMILIES]
  }
  assert carries == {
      "llama-tiny": True,
      "mistral-tiny": True,
      "mixtral-tiny": True,
      "qwen3-tiny": False,  # query/key norms would undo it
      "gpt3-tiny": False,  # fused qkv_proj, scaled at run time
      "deepseek3-tiny": False,  # MLA scales at run time
      "olmo2-tiny": False,  # its QK-norm would undo it
      "olmo3-tiny": False,
      "gemma-tiny": True,
      "gemma2-tiny": True,  # query_pre_attn_scalar ** -0.5 (head_dim by default)
      "gemma3-tiny": False,  # its QK-norm would undo it
      "qwen3-moe-tiny": False,  # query/key norms would undo it
      "gpt-oss-tiny": False,  # the query bias would need it too: scaled at run time
      "qwen3-next-tiny": False,  # query/key norms would undo it
      "llama4-tiny": False,  # the RoPE layers' QK-norm would undo it
      "gemma4-tiny": False,  # its QK-norm would undo it (and attention scales by 1)
      "qwen2.5-tiny": False,  # the query bias would need it too: scaled at run time
      "glm4.5-tiny": False,  # its query bias and QK-norm: scaled at run time
      "deepseek2-tiny": False,  # MLA scales at run time
      "deepseek3.2-tiny": False,  # MLA scales at run time
      "qwen3.5-tiny": False,  # query/key norms would undo it
  }

  def initial_std(preset, **overrides):
    model = mb.create_model(family_config(preset, scan_layers=False, **overrides), seed=0)
    stack = canonical.layer_paths(model.config)[0]
    kernel = canonical.flatten(model.params())[f"{stack}/self_attention/query/kernel"]
    return float(np.std(np.asarray(kernel))), model.config

  # MLA's own query kernel (no query LoRA) starts at the fan-in std, not pre-scaled by
  # 1/sqrt(head_dim) on top of the scale attention applies at run time.
  std, cfg = initial_std("deepseek3-tiny", q_lora_rank=0)
  np.testing.assert_allclose(std, cfg.emb_dim**-0.5, rtol=0.05)
  std, cfg = initial_std("llama-tiny")
  np.testing.assert_allclose(std, cfg.emb_dim**-0.5 * cfg.head_dim**-0.5, rtol=0.05)


@pytest.mark.parametrize(
    "preset, override, match",
    [
        ("qwen3-tiny", dict(use_qk_norm=False), "decoder_block='qwen3' normalises each query and key head"),
        ("gpt3-tiny", dict(sliding_window_size=4), "decoder_block='gpt3' .* reads neither sliding_window_size=4"),
        ("deepseek3-tiny", dict(use_qk_norm=True), "decoder_block='deepseek' .* nor use_qk_norm=True"),
    ],
)
def test_a_family_refuses_settings_its_layers_would_ignore_or_contradict(preset, override, match):
  with pytest.raises(mb.ConfigError, match=match):
    family_config(preset, **override)


def test_mistral_without_a_window_is_valid_as_in_mistral_7b_v0_2():
  assert family_config("mistral-tiny", sliding_window_size=0).sliding_window_size == 0


def test_learned_positions_follow_trainable_position_size_not_the_family_name():
  llama = canonical.flatten(
      dispatch.abstract_model(
          family_config("llama-tiny", trainable_position_size=16, max_target_length=16)
      ).abstract_params()
  )
  assert llama["decoder/position_embedder/embedding"].shape == (16, 64)
