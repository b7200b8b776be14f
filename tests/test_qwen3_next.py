"""Qwen3-Next (decoder_block qwen3_next): its gated DeltaNet (`ops.gated_deltanet`) and Hugging Face interchange.

The DeltaNet's reference is transformers' pure-torch fallbacks of Qwen3-Next's
kernels (`torch_chunk_gated_delta_rule`, `torch_recurrent_gated_delta_rule`,
`causal_conv1d_fn`), which run without fla. The inputs are random, with
grouped value heads, a non-zero initial state, and a sequence that is not a
whole number of chunks. The model's reference is a tiny random
`Qwen3NextForCausalLM` of 4 layers (one block: three DeltaNet layers and a
gated attention layer), saved with save_pretrained.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import optax
from flax import nnx

import linen_models.normalizations as linen_norms
import maxbridge as mb
import nnx_models.normalizations as nnx_norms
from maxbridge.core import canonical, initializers
from maxbridge.models import dispatch, lora
from maxbridge.ops import gated_deltanet as gdn
from maxbridge.ops import output_head
from maxbridge.training import optimizers

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")

from hf_family import BACKENDS, TINY, TOKENS, Saved, assert_matches_transformers, export_and_reimport  # noqa: E402
from hf_family import assert_same_tree, assert_tiled_nnx_matches_untiled_linen, family_config, int8_logits  # noqa: E402
from hf_family import highest_precision, train_steps  # noqa: E402,F401 (highest_precision: an autouse fixture)
from test_hf import LOGITS_TOL, max_diff  # noqa: E402

B, T, KEY_HEADS, VALUE_HEADS, K, V, CHUNK = 2, 37, 2, 4, 8, 6, 16


@pytest.fixture(scope="module")
def inputs():
  rng = np.random.default_rng(0)
  normal = lambda *shape: rng.normal(size=shape).astype(np.float32)
  return dict(
      q=normal(B, T, KEY_HEADS, K),
      k=normal(B, T, KEY_HEADS, K),
      v=normal(B, T, VALUE_HEADS, V),
      a=normal(B, T, VALUE_HEADS),
      b=normal(B, T, VALUE_HEADS),
      a_log=np.log(rng.uniform(0.01, 16, VALUE_HEADS)).astype(np.float32),  # transformers' initial range
      dt_bias=normal(VALUE_HEADS),
      state=normal(B, VALUE_HEADS, K, V),
  )


def _ours(x, form, state=True):
  g, beta = gdn.gating(x["a"], x["b"], x["a_log"], x["dt_bias"])
  q, k = gdn.l2_normalize(x["q"]), gdn.l2_normalize(x["k"])
  initial = x["state"] if state else None
  if form == "chunked":
    return gdn.chunked_gated_delta_rule(q, k, x["v"], g, beta, initial, chunk_size=CHUNK)
  return gdn.recurrent_gated_delta_rule(q, k, x["v"], g, beta, initial)


def _transformers(x, form):
  t = {name: torch.tensor(value) for name, value in x.items()}
  g = -t["a_log"].exp() * torch.nn.functional.softplus(t["a"] + t["dt_bias"])
  common = dict(initial_state=t["state"], output_final_state=True, use_qk_l2norm_in_kernel=True)
  if form == "chunked":
    out, state = qwen3_next.torch_chunk_gated_delta_rule(
        t["q"], t["k"], t["v"], g, t["b"].sigmoid(), chunk_size=CHUNK, **common
    )
  else:
    out, state = qwen3_next.torch_recurrent_gated_delta_rule(t["q"], t["k"], t["v"], g, t["b"].sigmoid(), **common)
  return out.numpy(), state.numpy()


def test_chunked_and_recurrent_forms_agree_to_float32_precision(inputs):
  for state in (True, False):
    chunked = _ours(inputs, "chunked", state)
    recurrent = _ours(inputs, "recurrent", state)
    for ours, theirs in zip(chunked, recurrent):
      np.testing.assert_allclose(ours, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("form", ["chunked", "recurrent"])
def test_each_form_matches_the_transformers_fallback(inputs, form):
  out, state = _ours(inputs, form)
  ref_out, ref_state = _transformers(inputs, form)
  np.testing.assert_allclose(out, ref_out, atol=1e-5, rtol=0)
  np.testing.assert_allclose(state, ref_state, atol=1e-5, rtol=0)


def test_the_gating_matters(inputs):
  """Without the decay (g = 0) or with beta = 1 the outputs leave transformers' by far more than the tolerance."""
  ref_out, _ = _transformers(inputs, "chunked")
  q, k = gdn.l2_normalize(inputs["q"]), gdn.l2_normalize(inputs["k"])
  g, beta = gdn.gating(inputs["a"], inputs["b"], inputs["a_log"], inputs["dt_bias"])
  for g_, beta_ in ((jnp.zeros_like(g), beta), (g, jnp.ones_like(beta))):
    out, _ = gdn.chunked_gated_delta_rule(q, k, inputs["v"], g_, beta_, inputs["state"], chunk_size=CHUNK)
    assert np.abs(np.asarray(out) - ref_out).max() > 1e-2


def test_a_long_prompt_then_steps_continue_the_state(inputs):
  """Prefill (chunked) up to t, then one recurrent step per token, gives the whole sequence's outputs and state."""
  g, beta = gdn.gating(inputs["a"], inputs["b"], inputs["a_log"], inputs["dt_bias"])
  q, k, v = gdn.l2_normalize(inputs["q"]), gdn.l2_normalize(inputs["k"]), inputs["v"]
  whole, final = gdn.chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=CHUNK)
  split = 21
  outs, state = gdn.chunked_gated_delta_rule(q[:, :split], k[:, :split], v[:, :split], g[:, :split], beta[:, :split])
  outs = [outs]
  for t in range(split, T):
    step = slice(t, t + 1)
    out, state = gdn.recurrent_gated_delta_rule(q[:, step], k[:, step], v[:, step], g[:, step], beta[:, step], state)
    outs.append(out)
  np.testing.assert_allclose(jnp.concatenate(outs, axis=1), whole, atol=1e-5, rtol=0)
  np.testing.assert_allclose(state, final, atol=1e-5, rtol=0)


def test_the_chunked_form_has_gradients_and_they_match_the_recurrent_ones(inputs):
  g, beta = gdn.gating(inputs["a"], inputs["b"], inputs["a_log"], inputs["dt_bias"])

  def loss(form, q, k, v):
    q, k = gdn.l2_normalize(q), gdn.l2_normalize(k)
    if form == "chunked":
      out, state = gdn.chunked_gated_delta_rule(q, k, v, g, beta, inputs["state"], chunk_size=CHUNK)
    else:
      out, state = gdn.recurrent_gated_delta_rule(q, k, v, g, beta, inputs["state"])
    return jnp.sum(jnp.sin(out)) + jnp.sum(jnp.cos(state))

  args = (inputs["q"], inputs["k"], inputs["v"])
  chunked = jax.grad(lambda *a: loss("chunked", *a), argnums=(0, 1, 2))(*args)
  recurrent = jax.grad(lambda *a: loss("recurrent", *a), argnums=(0, 1, 2))(*args)
  for ours, theirs in zip(chunked, recurrent):
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)


def test_causal_conv1d_matches_transformers_and_continues_from_its_window():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(B, T, 5)).astype(np.float32)
  kernel = rng.normal(size=(4, 5)).astype(np.float32)  # [W, C]; transformers' conv1d weight is [C, 1, W]
  out, window = gdn.causal_conv1d(x, kernel)
  ref = qwen3_next.causal_conv1d_fn(torch.tensor(x).transpose(1, 2), torch.tensor(kernel.T.copy()), None)
  np.testing.assert_allclose(out, ref.transpose(1, 2).numpy(), atol=1e-5, rtol=0)
  np.testing.assert_array_equal(window, x[:, -3:])
  steps, window = gdn.causal_conv1d(x[:, :30], kernel)
  steps = [steps]
  for t in range(30, T):
    one, window = gdn.causal_conv1d(x[:, t : t + 1], kernel, window)
    steps.append(one)
  np.testing.assert_allclose(jnp.concatenate(steps, axis=1), out, atol=1e-6, rtol=0)


def test_bad_shapes_name_what_is_wrong(inputs):
  g, beta = gdn.gating(inputs["a"], inputs["b"], inputs["a_log"], inputs["dt_bias"])
  with pytest.raises(ValueError, match=r"state \(2, 4, 6, 8\) must be \[B, Hv, K, V\] = \(2, 4, 8, 6\)"):
    gdn.chunked_gated_delta_rule(inputs["q"], inputs["k"], inputs["v"], g, beta, np.zeros((2, 4, 6, 8), np.float32))
  with pytest.raises(ValueError, match="3 value heads must be a multiple of the 2 key heads"):
    gdn.recurrent_gated_delta_rule(inputs["q"], inputs["k"], inputs["v"][:, :, :3], g[..., :3], beta[..., :3])
  with pytest.raises(ValueError, match=r"window \(2, 2, 5\) must be \[B, W-1, C\]"):
    gdn.causal_conv1d(np.zeros((2, 1, 5), np.float32), np.zeros((4, 5), np.float32), np.zeros((2, 2, 5), np.float32))


def test_packed_segments_do_not_leak_and_trailing_padding_keeps_the_last_state(inputs):
  """Two packed sequences then padding give each sequence's own outputs, and the second's final state and window."""
  g, beta = gdn.gating(inputs["a"], inputs["b"], inputs["a_log"], inputs["dt_bias"])
  q, k, v = gdn.l2_normalize(inputs["q"]), gdn.l2_normalize(inputs["k"]), inputs["v"]
  first, second = 15, 12  # then T - 27 = 10 padding tokens
  segments = np.array([[1] * first + [2] * second + [0] * (T - first - second)] * B)
  conv_in = np.asarray(v.reshape(B, T, -1))
  kernel = np.random.default_rng(2).normal(size=(4, conv_in.shape[-1])).astype(np.float32)
  packed_conv, packed_window = gdn.causal_conv1d(conv_in, kernel, segment_ids=segments)
  for form in ("chunked", "recurrent"):
    kwargs = dict(chunk_size=CHUNK) if form == "chunked" else {}
    rule = gdn.chunked_gated_delta_rule if form == "chunked" else gdn.recurrent_gated_delta_rule
    packed, packed_state = rule(q, k, v, g, beta, None, segments, **kwargs)
    for start, stop in ((0, first), (first, first + second)):
      part = slice(start, stop)
      alone, alone_state = rule(q[:, part], k[:, part], v[:, part], g[:, part], beta[:, part], **kwargs)
      np.testing.assert_allclose(packed[:, part], alone, atol=1e-5, rtol=0, err_msg=form)
    np.testing.assert_allclose(packed_state, alone_state, atol=1e-5, rtol=0, err_msg=form)
  alone_conv, alone_window = gdn.causal_conv1d(conv_in[:, first : first + second], kernel)
  np.testing.assert_allclose(packed_conv[:, first : first + second], alone_conv, atol=1e-6, rtol=0)
  np.testing.assert_array_equal(packed_window, alone_window)


# --- the model against transformers --------------------------------------------------------

DIMS = dict(
    **TINY,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=128,
    num_hidden_layers=4,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=64,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=12,
    rms_norm_eps=1e-6,
)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  torch.manual_seed(0)
  model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**DIMS))
  return Saved(model, tmp_path_factory.mktemp("qwen3_next") / "hf")


@pytest.fixture(scope="module")
def imported(reference):
  return mb.from_pretrained(reference.folder, backend="linen", scan_layers=True)


def test_imported_config_reads_the_deltanet_and_the_shared_expert(imported):
  cfg = imported.config
  assert (cfg.decoder_block, cfg.num_decoder_layers, cfg.shared_experts, cfg.partial_rotary_factor) == (
      "qwen3_next",
      4,
      2,
      0.25,
  )
  assert (cfg.gdn_num_key_heads, cfg.gdn_num_value_heads, cfg.gdn_key_head_dim, cfg.gdn_value_head_dim) == (2, 4, 8, 12)


# Logits, then 24 greedy tokens by `generate` and by mb.Engine: a prefill padded past the prompt (the DeltaNet
# state and window are those of its last real token), then one recurrent step per token in two decode slots.
@pytest.mark.parametrize("backend, scan_layers", [("linen", True), ("nnx", False)], ids=["linen-scanned", "nnx"])
def test_logits_and_a_24_token_greedy_continuation_match_transformers(reference, imported, backend, scan_layers):
  model = imported if backend == "linen" else mb.from_pretrained(reference.folder, backend=backend, scan_layers=False)
  assert_matches_transformers(model, reference)


@pytest.mark.parametrize("part", ["gating", "output_gate", "shared_expert_gate", "partial_rope"])
def test_each_qwen3_next_part_changes_the_logits(reference, imported, part, monkeypatch):
  """Without the DeltaNet's decay and write strength, the attention's output gate, the shared expert's gate, or
  with RoPE on whole heads, the logits leave transformers' by far more than the tolerance."""
  params = imported.params()
  block = params["decoder"]["layers"]
  if part == "gating":  # g = 0 (no decay) and beta = 1 (full writes), wherever gating is asked
    monkeypatch.setattr(gdn, "gating", lambda a, b, a_log, dt_bias: (jnp.zeros(a.shape), jnp.ones(b.shape)))
  elif part == "output_gate":  # the gate half of the query kernel zeroed: sigmoid(0) = 1/2 for every token
    kernel = block["full"]["self_attention"]["query"]["kernel"]
    block["full"]["self_attention"]["query"]["kernel"] = kernel.at[..., imported.config.head_dim :].set(0.0)
  elif part == "shared_expert_gate":
    for name in ("linear_0", "linear_1", "linear_2", "full"):
      block[name]["shared_expert_gate"]["kernel"] = jnp.zeros_like(block[name]["shared_expert_gate"]["kernel"])
  model = imported
  if part == "partial_rope":
    model = mb.from_pretrained(reference.folder, backend="linen", scan_layers=True, partial_rotary_factor=1.0)
    params = model.params()
  logits = jax.jit(lambda p: model.apply(p, jnp.asarray(TOKENS, jnp.int32)))(params)
  assert max_diff(logits, reference.logits) > 100 * LOGITS_TOL


def test_export_loads_in_transformers_and_reimports_the_same_tree(reference, tmp_path):
  exported, first, again = export_and_reimport(reference, tmp_path, transformers.Qwen3NextForCausalLM)
  assert exported.config.to_diff_dict() == {**reference.model.config.to_diff_dict(), "dtype": "float32"}
  assert_same_tree(first, again)  # every weight maps as it is: no norm's + 1 to undo and redo


# --- the zero-centred norms ------------------------------------------------------------------

GATED_NORM = "linear_attention/norm/scale"  # Qwen3NextRMSNormGated: the multiplier itself


def _norm_scales(params) -> dict:
  return {path: leaf for path, leaf in canonical.flatten(params).items() if path.endswith("/scale")}


def _multiplier(config, scale):
  """What the family's norm multiplies a unit-RMS input by, for a stored `scale`: the norm itself, run."""
  norm = output_head.final_norm(config.normalization, {"scale": scale}, epsilon=0.0, dtype=jnp.float32)
  return norm(jnp.ones((1, 1, scale.shape[-1]), jnp.float32))[0, 0]


@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_a_new_model_starts_its_zero_centred_norms_at_zero_and_the_gated_norm_at_one(backend):
  """`create_model`'s initialiser, run on the norm scales only of each backend's tree (the rest would cost a
  compile of the whole initialiser and is not what this test is about)."""
  config = family_config("qwen3-next-tiny", BACKENDS[backend], scan_layers=False)
  abstract = _norm_scales(dispatch.abstract_model(config).abstract_params())
  scales = canonical.flatten(
      initializers.init_params(canonical.unflatten(abstract), 0, initializers.InitOptions.from_config(config))
  )
  zero_centred = [path for path in scales if not path.endswith(GATED_NORM)]
  assert {path.split("/")[-2] for path in zero_centred} == {
      "decoder_norm",
      "pre_self_attention_layer_norm",
      "post_self_attention_layer_norm",
      "query_norm",
      "key_norm",
  }
  for path, scale in scales.items():
    np.testing.assert_array_equal(scale, 1.0 if path.endswith(GATED_NORM) else 0.0, err_msg=path)


@pytest.mark.parametrize("backend", ["linen", "nnx"])
def test_the_zero_centred_norm_multiplies_by_one_plus_its_scale_as_transformers(backend):
  rng = np.random.default_rng(1)
  x = rng.normal(size=(2, 5, 24)).astype(np.float32)
  w = (0.3 * rng.normal(size=24)).astype(np.float32)
  hf_norm = qwen3_next.Qwen3NextRMSNorm(24, eps=1e-6)
  with torch.no_grad():
    hf_norm.weight.copy_(torch.tensor(w))
    expected = hf_norm(torch.tensor(x)).numpy()
  by_hand = x / np.sqrt(np.mean(x**2, axis=-1, keepdims=True) + 1e-6) * (1 + w)
  np.testing.assert_allclose(expected, by_hand, rtol=1e-5, atol=1e-6)
  if backend == "linen":
    got = linen_norms.ZeroCentredRMSNorm(24, 1e-6).apply({"params": {"scale": w}}, x)
  else:
    module = nnx_norms.ZeroCentredRMSNorm(24, 1e-6, rngs=nnx.Rngs(0))
    module.scale[...] = w
    got = module(x)
  np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-6)
  # The final norm as vocabulary tiling's head applies it, outside the modules.
  head_norm = output_head.final_norm("zero_centred_rms_norm", {"scale": w}, epsilon=1e-6, dtype=jnp.float32)
  np.testing.assert_allclose(head_norm(x), expected, rtol=1e-6, atol=1e-6)


def test_imported_norms_hold_transformers_weights_as_they_are(reference, imported):
  params = canonical.flatten(canonical.unstack_layers(imported.params(), imported.config.param_scan_axis))
  hf = {name: tensor.detach().numpy() for name, tensor in reference.model.state_dict().items()}
  np.testing.assert_array_equal(params["decoder/decoder_norm/scale"], hf["model.norm.weight"])
  layer = "decoder/layers_0/full"  # the block's fourth layer: transformers' layer 3
  for ours, theirs in [
      ("pre_self_attention_layer_norm", "input_layernorm"),
      ("post_self_attention_layer_norm", "post_attention_layernorm"),
      ("self_attention/query_norm", "self_attn.q_norm"),
      ("self_attention/key_norm", "self_attn.k_norm"),
  ]:
    np.testing.assert_array_equal(params[f"{layer}/{ours}/scale"], hf[f"model.layers.3.{theirs}.weight"])
  np.testing.assert_array_equal(
      params[f"decoder/layers_0/linear_0/{GATED_NORM}"], hf["model.layers.0.linear_attn.norm.weight"]
  )


def test_weight_decay_pulls_the_zero_centred_norms_multiplier_toward_one(imported):
  """AdamW with a zero gradient only decays: the stored w shrinks, so the multiplier 1 + w nears 1 (a tree that
  held the multiplier itself would send it toward 0, switching the layer off)."""
  config = imported.config.replace(adam_weight_decay=0.1, learning_rate=0.5, warmup_steps_fraction=0.0)
  # AdamW treats each leaf alone: the norms' scales, per layer, stand for the tree.
  params = _norm_scales(canonical.unstack_layers(imported.params(), config.param_scan_axis))
  optimizer = optimizers.adamw(config)
  updates, _ = optimizer.update(jax.tree.map(jnp.zeros_like, params), optimizer.init(params), params)
  decayed = optax.apply_updates(params, updates)
  for path, scale in params.items():
    if path.endswith(GATED_NORM):
      continue
    before = np.abs(_multiplier(config, scale) - 1.0)
    after = np.abs(_multiplier(config, decayed[path]) - 1.0)
    assert np.all(after < before) and np.all(after > 0.9 * before), path  # one step of lr * decay = 5%
    np.testing.assert_allclose(decayed[path], 0.95 * scale, rtol=1e-6, err_msg=path)


def test_a_chunked_prefill_continues_the_recurrent_state_and_prefill_concat_is_refused(reference, imported):
  """A prompt prefilled in two chunks (the second from the first's DeltaNet state, window and KV cache) decodes
  transformers' tokens; a packed prefill, which would need each prompt's state, is refused by name."""
  from hf_family import PROMPT

  config = imported.config.replace(per_device_batch_size=1, max_prefill_predict_length=8)
  engine = mb.Engine(config, model=imported)
  prefix = engine.prefill(PROMPT[0][:2])
  prefix = engine.prefill(PROMPT[0][2:], existing_prefix=prefix)
  state = engine.insert(prefix, engine.init_decode_state(), 0)
  state, tokens = engine.generate_steps(state, 5)
  got = np.concatenate([[int(prefix.token)], np.asarray(tokens)[0]])
  np.testing.assert_array_equal(got, reference.continuation[0, PROMPT.shape[1] : PROMPT.shape[1] + 6])
  with pytest.raises(ValueError, match="prefill_concat with decoder_block='qwen3_next': its recurrent layers"):
    engine.prefill_concat([PROMPT[0], PROMPT[1]])


def test_config_rules_name_what_qwen3_next_needs():
  from maxbridge.core.config import ConfigError

  with pytest.raises(ConfigError, match="base_num_decoder_layers=6 must be a multiple of 4"):
    mb.load_config("qwen3-next-tiny", base_num_decoder_layers=6)
  # QK-Clip: refused on every layer, by the query/key-norm rule and, without the norms, by the family's own.
  with pytest.raises(ConfigError, match=r"use_qk_clip=true with use_qk_norm=true"):
    mb.load_config("qwen3-next-tiny", use_qk_clip=True)
  with pytest.raises(ConfigError, match=r"use_qk_clip=true with decoder_block='qwen3_next': QK-Clip bounds"):
    mb.load_config("qwen3-next-tiny", use_qk_clip=True, use_qk_norm=False)
  with pytest.raises(ConfigError, match=r"mtp_num_layers=1 with decoder_block='qwen3_next'"):
    mb.load_config("qwen3-next-tiny", mtp_num_layers=1)
  with pytest.raises(ConfigError, match=r"gdn_num_key_heads=4 is read by decoder_block='qwen3_next' and 'qwen3_5' only"):
    mb.load_config("qwen3-moe-tiny", gdn_num_key_heads=4)
  with pytest.raises(ConfigError, match="gdn_num_value_heads=3 must be a multiple of gdn_num_key_heads=2"):
    mb.load_config("qwen3-next-tiny", gdn_num_value_heads=3)
  with pytest.raises(ConfigError, match=r"partial_rotary_factor=0.1 x head_dim=16 = 1 dims"):
    mb.load_config("qwen3-next-tiny", partial_rotary_factor=0.1)


# --- features on both backends ---------------------------------------------------------------

PRESET = "qwen3-next-tiny"
# Rows of 16 tokens (one DeltaNet chunk each), packed and segmented as the embedded data comes.
FEATURES = dict(per_device_batch_size=2, max_target_length=16)


def test_vocab_tiling_on_nnx_gives_untiled_linens_loss_and_gradients():
  """The tiled head applies the zero-centred final norm outside the modules, so a tiled loss that forgot its
  1 + w differs. (Its first DeltaNet layer's gradients are near 10, through its L2-normalised queries and keys:
  the tolerance scales with each leaf's largest.)"""
  assert_tiled_nnx_matches_untiled_linen(PRESET, **FEATURES)


def test_lora_adapts_the_deltanet_and_attention_projections_and_trains_alike_on_both_backends():
  """The default lora_module_path reaches every projection of both layer kinds and the shared experts; the
  DeltaNet's out_proj [heads, head_dim, embed] reads two input axes (its logical axes say so). Three steps on one
  batch (the first at warm-up's learning rate 0): the last loss is lower, on both backends alike."""
  losses = {}
  for backend, flags in BACKENDS.items():
    config = family_config(PRESET, flags, lora_rank=4, lora_alpha=8.0, learning_rate=1e-2, **FEATURES)
    losses[backend] = train_steps(config, one_batch=True)[0]
  model = dispatch.abstract_model(config)
  targets = lora.targets(config, model.abstract_params())
  assert {path.split("/", 3)[-1] for path in targets} == {
      *(f"self_attention/{name}/kernel" for name in ("query", "key", "value", "out")),
      *(f"linear_attention/{name}/kernel" for name in ("in_proj_qkvz", "in_proj_ba", "out_proj")),
      *(f"shared_expert/{name}/kernel" for name in ("wi_0", "wi_1", "wo")),
  }
  assert len(targets) == 4 + 3 * 3 + 4 * 3, targets
  adapters = canonical.flatten(lora.abstract_adapters(config, model.abstract_params(), model.logical_axes()))
  # [heads, layers, head_dim, rank] and [rank, layers, embed]: heads x head_dim in, the width out.
  out_proj = "decoder/layers/linear_0/linear_attention/out_proj/kernel"
  assert (adapters[out_proj + "_lora_a"].shape, adapters[out_proj + "_lora_b"].shape) == ((4, 1, 16, 4), (4, 1, 64))
  assert np.all(np.isfinite(losses["linen"])) and losses["linen"][-1] < losses["linen"][0] - 1e-2, losses
  np.testing.assert_allclose(losses["nnx"], losses["linen"], rtol=0, atol=1e-5)


def test_aqt_int8_quantizes_alike_on_both_backends():
  """AQT quantizes the dense projections of both layer kinds; the delta rule has no weights and stays float32."""
  float_logits, linen, nnx = int8_logits(PRESET)
  assert np.all(np.isfinite(linen))
  assert np.abs(linen - float_logits).max() > 1e-3  # int8 rounding moves the logits past float noise
  np.testing.assert_allclose(nnx, linen, atol=1e-6, rtol=0)
