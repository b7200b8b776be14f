"""Gemma 4 (decoder_block gemma4, text only): Hugging Face import on both backends, its own features.

The reference is a tiny random `Gemma4ForCausalLM` (text config) of 12 layers
saved with save_pretrained: two blocks of five sliding-window layers and a
global one, the second block sharing the first's keys/values
(num_kv_shared_layers=6). Global layers are wider (global_head_dim), have one
key/value head whose values are their keys' projection (attention_k_eq_v) and
proportional RoPE over a quarter of their pairs; every layer has its own input
(hidden_size_per_layer_input), a value norm and a layer scalar (randomized).
`test_each_gemma4_feature_changes_the_logits` shows that without each of them
the logits leave transformers'.
"""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import maxbridge as mb  # noqa: E402
from maxbridge.core import canonical  # noqa: E402
from maxbridge.core.config import ConfigError  # noqa: E402
from maxbridge.interop import hf  # noqa: E402
from maxbridge.models import decoding, dispatch, lora  # noqa: E402
from hf_family import BACKENDS, PROMPT, TOKENS, Saved, assert_matches_transformers, export_and_reimport  # noqa: E402
from hf_family import assert_tiled_nnx_matches_untiled_linen, family_config, int8_logits  # noqa: E402
from hf_family import highest_precision, train_steps  # noqa: E402,F401 (highest_precision: an autouse fixture)
from test_hf import LOGITS_TOL, max_diff  # noqa: E402

HIDDEN = 64
ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 10000.0},
}
DIMS = dict(
    hidden_size=HIDDEN,
    vocab_size=256,
    vocab_size_per_layer_input=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    global_head_dim=32,
    num_global_key_value_heads=1,
    attention_k_eq_v=True,
    intermediate_size=128,
    num_hidden_layers=12,
    num_kv_shared_layers=6,
    hidden_size_per_layer_input=8,
    sliding_window=4,
    rope_parameters=ROPE,
    initializer_range=0.1,
    rms_norm_eps=1e-6,
    final_logit_softcapping=30.0,
)


def constant_buffers(model):
  """The embedding scales are constant buffers, which randomize drew too; the layer scalars stay random."""
  with torch.no_grad():
    model.model.embed_tokens.embed_scale.fill_(HIDDEN**0.5)
    model.model.embed_tokens_per_layer.embed_scale.fill_(DIMS["hidden_size_per_layer_input"] ** 0.5)
    for layer in model.model.layers:
      layer.layer_scalar.uniform_(0.5, 1.5)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
  torch.manual_seed(0)
  model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**DIMS))
  return Saved(model, tmp_path_factory.mktemp("gemma4") / "hf", prepare=constant_buffers)


@pytest.fixture(scope="module")
def imported(reference):
  """The reference imported unscanned on NNX: its config and flat canonical tree."""
  model = mb.from_pretrained(reference.folder, backend="nnx", scan_layers=False)
  return model.config, canonical.flatten(model.params())


# Scanned Linen and unscanned NNX; the parity matrix (test_families.py) covers the other combinations.
@pytest.mark.parametrize("backend, scan_layers", [("linen", True), ("nnx", False)], ids=["linen-scanned", "nnx"])
def test_imported_logits_and_a_24_token_greedy_continuation_match_transformers(reference, backend, scan_layers):
  model = mb.from_pretrained(reference.folder, backend=backend, scan_layers=scan_layers)
  assert model.config.pure_nnx == (backend == "nnx")
  assert_matches_transformers(model, reference, max_target_length=64)


def test_cached_decode_equals_recompute_and_shared_layers_keep_no_cache(reference):
  """A prefill then one cached step gives the logits of the whole sequence recomputed; the KV-shared layers
  read the cache of the last earlier layer of their kind (a ring, for the sliding-window ones) and hold none. (Both backends decode
  through the engine in the test above; the cache tree is one canonical tree.)"""
  model = mb.from_pretrained(reference.folder, backend="nnx", scan_layers=False)  # as decoding runs it
  cache = decoding.init_cache(model.config, 2, 16)
  paths = canonical.flatten(cache)
  assert not [path for path in paths if path.startswith("decoder/kv_shared_layers")]
  # Keys are stored [batch, kv heads, head_dim, tokens] (`ops.kv_cache`): global layers' wider, with fewer heads,
  # and every token; sliding-window layers a ring of their window (DIMS' sliding_window=4), which the prompt
  # below overruns.
  assert paths["decoder/layers_0/global/self_attention/cached_key"].shape == (2, 1, 32, 16)
  assert paths["decoder/layers_0/local_4/self_attention/cached_key"].shape == (2, 2, 16, 4)
  assert len(PROMPT[0]) > model.config.sliding_window_size == 4
  prompt = jnp.asarray(PROMPT, jnp.int32)
  batch, length = prompt.shape
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), prompt.shape)
  params = model.params()
  _, cache = model.cached_forward(params, cache, prompt, positions, jnp.ones_like(prompt))
  step = jnp.full((batch, 1), 7, jnp.int32)
  logits, _ = model.cached_forward(params, cache, step, jnp.full((batch, 1), length), jnp.ones_like(step))
  full = model.logits(jnp.concatenate([prompt, step], axis=1))
  np.testing.assert_allclose(np.asarray(logits).reshape(batch, -1), np.asarray(full[:, -1]), atol=5e-5)


def test_the_config_and_tree_read_as_transformers_builds_the_model(reference, imported):
  cfg, flat = imported
  assert canonical.layer_stacks(cfg) == (("layers", 1), ("kv_shared_layers", 1))
  assert (cfg.global_head_dim, cfg.global_num_kv_heads, cfg.share_kv_projections) == (32, 1, True)
  assert (cfg.global_rope_proportion, cfg.local_rope_max_timescale, cfg.rope_max_timescale) == (0.25, 100, 10000)
  assert (cfg.hidden_size_per_layer_input, cfg.num_kv_shared_layers) == (8, 6)
  # The shared layers have no key/value weights (transformers builds none), and global layers no value kernel.
  for sub in ("local_0", "global"):
    assert not [path for path in flat if path.startswith(f"decoder/kv_shared_layers_0/{sub}/self_attention/key")]
  assert "decoder/layers_0/global/self_attention/value/kernel" not in flat
  assert flat["decoder/layers_0/global/self_attention/key/kernel"].shape == (HIDDEN, 1, 32)
  # Norm scales hold transformers' weights as they are (no 1 + w); the layer scalar too.
  layers = reference.model.model.layers
  np.testing.assert_allclose(
      flat["decoder/kv_shared_layers_0/global/layer_scalar"], layers[11].layer_scalar.detach().numpy(), rtol=1e-6
  )
  np.testing.assert_allclose(
      flat["decoder/layers_0/local_3/self_attention/key_norm/scale"],
      layers[3].self_attn.k_norm.weight.detach().numpy(),
      rtol=1e-6,
  )


def _without(flat: dict, prefix: str) -> dict:
  return {path: jnp.zeros_like(value) if path.startswith(prefix) else value for path, value in flat.items()}


def test_each_gemma4_feature_changes_the_logits(reference, imported):
  """Without a feature the logits leave transformers' (which the import matches)."""
  cfg, flat = imported
  tokens = jnp.asarray(TOKENS, jnp.int32)

  def distance(config, tree) -> float:
    return max_diff(mb.create_model(config, params=canonical.unflatten(tree)).logits(tokens), reference.logits)

  assert distance(cfg, flat) <= LOGITS_TOL
  # Per-layer inputs: a zero table and projection give each layer a zero input (then a zero addition).
  assert distance(cfg, _without(flat, "decoder/per_layer_inputs/")) > 0.05
  # KV sharing: the last block computes its own keys/values (with the weights of the layers it shared).
  unshared = {}
  for path, value in flat.items():
    unshared[path.replace("decoder/kv_shared_layers_0/", "decoder/layers_1/")] = value
    if path.startswith("decoder/layers_0/") and ("/self_attention/key" in path or "/self_attention/value" in path):
      unshared[path.replace("decoder/layers_0/", "decoder/layers_1/")] = value
  assert distance(cfg.replace(num_kv_shared_layers=0), unshared) > 0.05
  # Proportional RoPE over a quarter of the global pairs, not all of them; the local theta.
  assert distance(cfg.replace(global_rope_proportion=1.0), flat) > 0.05
  assert distance(cfg.replace(local_rope_max_timescale=10000), flat) > 0.05


@pytest.mark.parametrize("preset, billions", [("gemma4-31b", (30, 32)), ("gemma4-26b", (25, 27))])
def test_the_real_size_presets_build_abstract_models(preset, billions):
  big = mb.load_config(preset)
  abstract = canonical.flatten(dispatch.abstract_model(big).abstract_params())
  assert abstract["decoder/layers/global/self_attention/key/kernel"].shape[-1] == big.global_head_dim
  low, high = billions
  assert low * 1e9 < sum(int(np.prod(leaf.shape)) for leaf in abstract.values()) < high * 1e9
  assert (big.num_experts > 1) == (preset == "gemma4-26b")


def test_the_moe_tiny_preset_has_experts_and_router_scales_in_every_layer():
  cfg = mb.load_config("gemma4-moe-tiny")
  flat = canonical.flatten(dispatch.abstract_model(cfg).abstract_params())
  assert flat["decoder/layers/local_0/moe_block/wi_0"].shape == (4, 1, 64, 32)  # [E, layers, D, F]
  assert flat["decoder/kv_shared_layers/global/moe_block/gate/per_expert_scale"].shape == (4, 1)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(base_num_decoder_layers=8), r"base_num_decoder_layers=8 must be a multiple of 6"),
        (dict(num_kv_shared_layers=3), r"num_kv_shared_layers=3 must be a multiple of 6"),
        (dict(num_kv_shared_layers=12), r"num_kv_shared_layers=12 must be a multiple of 6 .* below"),
        (dict(use_qk_norm=False), r"set use_qk_norm=true"),
        (dict(global_num_kv_heads=3), r"global_num_kv_heads=3 must divide the query heads 4"),
    ],
)
def test_bad_gemma4_configs_name_the_keys(overrides, match):
  with pytest.raises(ConfigError, match=match):
    mb.load_config("gemma4-tiny", **overrides)


def test_other_families_refuse_the_gemma4_keys():
  with pytest.raises(ConfigError, match="hidden_size_per_layer_input"):
    mb.load_config("gemma3-tiny", hidden_size_per_layer_input=8)
  with pytest.raises(ConfigError, match="use_double_wide_mlp"):
    mb.load_config("gemma3-tiny", use_double_wide_mlp=True)


def test_double_wide_mlps_are_the_kv_shared_layers_and_need_some():
  """use_double_wide_mlp (Gemma 4 E2B's): the KV-shared stack's MLP kernels are twice as wide, the others not;
  without KV-shared layers it would widen nothing, so it is refused naming both keys."""
  config = mb.load_config("gemma4-tiny", use_double_wide_mlp=True)  # its last 6 of 12 layers share keys/values
  shapes = {
      path: leaf.shape for path, leaf in canonical.flatten(dispatch.abstract_model(config).abstract_params()).items()
  }
  wide = {path: shape for path, shape in shapes.items() if path.endswith("mlp/wi_0/kernel")}
  assert wide and all(shape[-1] == (2 if "kv_shared" in path else 1) * config.mlp_dim for path, shape in wide.items())
  assert any("kv_shared" in path for path in wide), sorted(wide)
  logits = {
      name: np.asarray(dispatch.create_model(config.replace(**dict(zip(dispatch.FLAGS, flags))), seed=0).logits(TOKENS))
      for name, flags in BACKENDS.items()
  }
  assert max_diff(logits["nnx"], logits["linen"]) <= 1e-6
  with pytest.raises(ConfigError, match="use_double_wide_mlp=true widens the KV-shared layers' MLPs: set num_kv_shared"):
    mb.load_config("gemma4-tiny", use_double_wide_mlp=True, num_kv_shared_layers=0)


def test_hf_configs_gemma4_cannot_run_are_refused():
  raw = {"model_type": "gemma4_text", **DIMS}
  with pytest.raises(hf.HFError, match="vocab_size_per_layer_input=512 must equal vocab_size=256"):
    hf.config_from_hf({**raw, "vocab_size_per_layer_input": 512})


# --- the MoE variant (gemma4-26b's shape: no per-layer inputs, no shared keys/values) -----------------------

MOE_DIMS = {
    **DIMS,
    "num_hidden_layers": 6,
    "num_kv_shared_layers": 0,
    "hidden_size_per_layer_input": 0,
    "enable_moe_block": True,
    "num_experts": 4,
    "top_k_experts": 2,
    "moe_intermediate_size": 32,
}


def moe_constant_buffers(model):
  """As `constant_buffers`; the router's scales near 1 too (randomize draws them near 0, as it does biases)."""
  with torch.no_grad():
    model.model.embed_tokens.embed_scale.fill_(HIDDEN**0.5)
    for layer in model.model.layers:
      layer.layer_scalar.uniform_(0.5, 1.5)
      layer.router.scale.uniform_(0.5, 1.5)
      layer.router.per_expert_scale.uniform_(0.5, 1.5)


@pytest.fixture(scope="module")
def moe_reference(tmp_path_factory):
  torch.manual_seed(1)
  model = transformers.Gemma4ForCausalLM(transformers.Gemma4TextConfig(**MOE_DIMS))
  return Saved(model, tmp_path_factory.mktemp("gemma4_moe") / "hf", generate=False, prepare=moe_constant_buffers)


@pytest.mark.parametrize("backend, sparse", [("linen", True), ("nnx", False)], ids=["linen-dropless", "nnx-dense"])
def test_the_moe_variant_imports_with_transformers_logits(moe_reference, backend, sparse):
  model = mb.from_pretrained(moe_reference.folder, backend=backend, sparse_matmul=sparse)
  cfg = model.config
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_mlp_dim) == (4, 2, 32)
  tokens = jnp.asarray(TOKENS, jnp.int32)
  assert max_diff(model.logits(tokens), moe_reference.logits) <= LOGITS_TOL
  if backend == "nnx":  # the router's per-expert scale (randomized) moves the logits: without it they leave transformers'
    flat = canonical.flatten(model.params())
    unscaled = {
        path: jnp.ones_like(value) if path.endswith("gate/per_expert_scale") else value for path, value in flat.items()
    }
    without = mb.create_model(cfg, params=canonical.unflatten(unscaled))
    assert max_diff(without.logits(tokens), moe_reference.logits) > 0.05


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_export_loads_in_transformers_and_reimports_the_same_tree(reference, moe_reference, variant, tmp_path):
  saved = reference if variant == "dense" else moe_reference
  # The tables' float32 rounding of sqrt(width) moves these deep random models' logits by up to ~2e-5.
  exported, first, again = export_and_reimport(saved, tmp_path, transformers.Gemma4ForCausalLM, tol=5e-5)
  assert exported.config.to_diff_dict() == {**saved.model.config.to_diff_dict(), "dtype": "float32"}
  # The tables' sqrt(width) are undone and redone: equal up to float32 rounding.
  for path in first:
    np.testing.assert_allclose(again[path], first[path], rtol=1e-6, atol=1e-7, err_msg=path)


# --- features on both backends (gemma4-tiny: per-layer inputs, KV-shared layers, a window shorter than the rows) ---

PRESET = "gemma4-tiny"
FEATURES = dict(per_device_batch_size=2, max_target_length=16)
# Tiling, LoRA and AQT act on the head and the canonical tree's kernels, whatever the layers: their rows run one block
# (half the compile; the KV-shared block's layers hold a subset of its kernels). LoRA's path check reads both stacks,
# and the recipes' rows (test_family_recipes.py) and the matrix (test_families.py) run the KV-shared block.
ONE_BLOCK = dict(base_num_decoder_layers=6, num_kv_shared_layers=0, **FEATURES)


def test_vocab_tiling_on_nnx_gives_untiled_linens_loss_and_gradients():
  """The tiled head soft-caps and scales the tied table's logits as the untiled one does."""
  assert_tiled_nnx_matches_untiled_linen(PRESET, **ONE_BLOCK)


def test_lora_default_path_adapts_every_projection_and_trains_alike_on_both_backends():
  """The default lora_module_path reaches the attention and MLP projections of both stacks (the KV-shared
  layers have queries and outputs only). Three steps on one batch (the first at warm-up's learning rate 0): the
  last loss is lower, on both backends alike."""
  lora_flags = dict(lora_rank=4, lora_alpha=8.0, learning_rate=1e-2)
  losses = {}
  for backend, flags in BACKENDS.items():
    losses[backend] = train_steps(family_config(PRESET, flags, **lora_flags, **ONE_BLOCK), one_batch=True)[0]
  whole = family_config(PRESET, BACKENDS["nnx"], **lora_flags)  # both stacks
  targets = lora.targets(whole, dispatch.abstract_model(whole).abstract_params())
  mlp = [f"mlp/{name}/kernel" for name in ("wi_0", "wi_1", "wo")]
  attention = [f"self_attention/{name}/kernel" for name in ("query", "key", "value", "out")]
  local = [f"local_{i}/{name}" for i in range(5) for name in attention + mlp]
  own = {f"decoder/layers/{name}" for name in local} | {
      f"decoder/layers/global/{name}" for name in attention + mlp if "value" not in name  # values: the keys'
  }
  shared = {f"decoder/kv_shared_layers/{name}" for name in local + [f"global/{n}" for n in attention + mlp]}
  shared = {path for path in shared if "/key/" not in path and "/value/" not in path}
  assert set(targets) == own | shared, sorted(set(targets) ^ (own | shared))
  assert np.all(np.isfinite(losses["linen"])) and losses["linen"][-1] < losses["linen"][0] - 1e-2, losses
  np.testing.assert_allclose(losses["nnx"], losses["linen"], rtol=0, atol=1e-5)


def test_aqt_int8_quantizes_alike_on_both_backends():
  """AQT quantizes every dense projection, the per-layer inputs' too (the routed experts of gemma4-moe-tiny stay
  float, as every family's: README's Gemma 4 paragraph)."""
  float_logits, linen, nnx = int8_logits(PRESET, **ONE_BLOCK)
  assert np.all(np.isfinite(linen))
  assert np.abs(linen - float_logits).max() > 1e-3  # int8 rounding moves the logits past float noise
  np.testing.assert_allclose(nnx, linen, atol=1e-6, rtol=0)
