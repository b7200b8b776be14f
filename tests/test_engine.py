"""The KV-cache engine: cached decoding equals the full forward, on both backends and a bridged mix, every family."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import converters
import maxbridge as mb
from maxbridge.core import canonical, sharding
from maxbridge import cli
from maxbridge.serving import engine
from maxbridge.models import model as model_lib
from maxbridge.ops import kv_cache, sampling
from maxbridge.models import decoding

FAMILIES = (
    "llama-tiny",
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
    "llama4-tiny",
    "qwen3-next-tiny",  # DeltaNet layers: a recurrent state per slot beside the attention layer's KV cache
    "gemma4-tiny",  # KV-shared layers: no cache of their own, they read the last earlier layer's of their kind
)
LINEN, NNX, MIX = (False, False, False), (True, True, True), (True, True, False)  # MIX: NNX model, bridged Linen decoder
# Of different lengths, so the slots decode at different positions; mistral-tiny's
# window (8) is shorter than both sequences, so decode reads are window-bounded.
PROMPTS = (np.array([5, 9, 3, 77, 12]), np.arange(1, 12))
STEPS = 5


def make_engine(preset: str, flags, **overrides) -> engine.Engine:
  """Two decode slots, prompts up to 16 tokens, rows of 32 (`overrides` win)."""
  config = mb.load_config(
      preset,
      pure_nnx=flags[0],
      enable_nnx=flags[1],
      pure_nnx_decoder=flags[2],
      **{"per_device_batch_size": 2, "max_prefill_predict_length": 16, "max_target_length": 32, **overrides},
  )
  return engine.Engine(config, mb.create_model(config, seed=0).params())


@functools.lru_cache(maxsize=None)
def decode(preset: str, flags) -> dict:
  """Both prompts prefilled and inserted (the longer into slot 0), then STEPS steps of generate."""
  eng = make_engine(preset, flags)
  prefixes = [eng.prefill(prompt) for prompt in PROMPTS]
  state = eng.init_decode_state()
  state = eng.insert(prefixes[1], state, 0)
  state = eng.insert(prefixes[0], state, 1)
  tokens, logits = [state.tokens[::-1]], [state.logits[::-1]]
  for _ in range(STEPS):
    state, new = eng.generate(state)
    tokens.append(new[::-1])
    logits.append(state.logits[::-1])
  return dict(
      engine=eng,
      prefixes=prefixes,
      tokens=np.stack(tokens, axis=1),  # [prompt, step]
      logits=np.stack(logits, axis=1),  # [prompt, step, V]
  )


# Every family on NNX. On Linen, whose one attention layer reads and writes the cache for every family
# (linen_models/attention.py), each kind of attention once: a family is left out where another in the list has its
# attention's cache path and more (Qwen3's QK-norm in Gemma 3's; Mixtral's and Qwen3-MoE's attention is Mistral's and Qwen3's;
# OLMo 2's in OLMo 3's, windowed; Gemma's query scale in Gemma 2's and 3's, its single KV head in Gemma 4's global
# layers).
LINEN_FAMILIES = tuple(
    p for p in FAMILIES if p not in ("qwen3-tiny", "mixtral-tiny", "qwen3-moe-tiny", "olmo2-tiny", "gemma-tiny")
)
CASES = [(preset, LINEN) for preset in LINEN_FAMILIES] + [(preset, NNX) for preset in FAMILIES] + [("llama-tiny", MIX)]


@pytest.mark.parametrize(
    "preset, flags", CASES, ids=[f"{p}-{ {LINEN: 'linen', NNX: 'nnx', MIX: 'mix'}[f]}" for p, f in CASES]
)
def test_cached_decoding_is_the_full_forward_in_two_slots_of_different_lengths(preset, flags):
  result = decode(preset, flags)
  sequences = [np.concatenate([prompt, tokens]) for prompt, tokens in zip(PROMPTS, result["tokens"])]
  # Causal: the full forward of the finished sequence at t is what a full recompute saw at
  # t, and right padding (to batch both in one call) changes nothing before it.
  batch = np.zeros((2, max(map(len, sequences))), np.int32)
  for i, sequence in enumerate(sequences):
    batch[i, : len(sequence)] = sequence
  all_logits = np.asarray(result["engine"].model.logits(batch))
  for i, prompt in enumerate(PROMPTS):
    full = all_logits[i, len(prompt) - 1 : len(prompt) + STEPS]
    np.testing.assert_array_equal(result["tokens"][i], np.argmax(full, axis=-1), err_msg=f"prompt {i}")
    np.testing.assert_allclose(result["logits"][i], full, atol=1e-5, rtol=1e-5, err_msg=f"prompt {i}")


@pytest.mark.parametrize("preset", ["llama-tiny", "deepseek3-tiny", "qwen3-next-tiny"])
def test_the_cache_tree_is_identical_on_linen_and_nnx(preset):
  linen, nnx_ = (canonical.flatten(decode(preset, flags)["prefixes"][1].cache) for flags in (LINEN, NNX))
  want = canonical.flatten(decoding.abstract_cache(decode(preset, LINEN)["engine"].config, 1, 32))
  assert sorted(linen) == sorted(nnx_) == sorted(want)
  for path, leaf in linen.items():
    assert leaf.shape == want[path].shape and leaf.dtype == want[path].dtype, path
    np.testing.assert_allclose(nnx_[path], leaf, atol=1e-6, err_msg=path)
  if preset == "deepseek3-tiny":  # MLA caches the latent and the rope key, not expanded keys and values
    assert {path.rsplit("/", 1)[1] for path in linen} >= {"cached_latent", "cached_key_rope"}
    assert not any("cached_key/" in path or path.endswith("cached_value") for path in linen)
  if preset == "qwen3-next-tiny":  # the DeltaNet layers keep a fixed-size state, the attention layer a KV cache
    assert {path.rsplit("/", 2)[-2] for path in linen} == {"linear_attention", "self_attention"}
    assert linen["decoder/layers_0/linear_0/linear_attention/recurrent_state"].shape == (1, 4, 16, 16)


def compiled_ops(eng: engine.Engine, jitted, *args, **static) -> list[str]:
  """The instructions of `jitted`'s compiled program, without what names each backend's modules.

  Dropped: each instruction's and value's name, and its metadata, frontend
  attributes and stack frame (source lines and op names differ by backend).
  """
  with sharding.active(eng.mesh, eng.config.logical_axis_rules):
    text = jitted.lower(*args, **static).compile().as_text()
  text = re.sub(r", (metadata|frontend_attributes)=\{[^}]*\}|, stack_frame_id=\d+", "", text)
  return [re.sub(r"%[\w.\-]+", "%", line) for line in text.splitlines() if " = " in line]


def test_linen_and_nnx_compile_one_and_the_same_prefill_and_decode_step():
  # Same speed by construction: the engine's hot paths lower to the same XLA program on both backends.
  engines = [decode("llama-tiny", flags)["engine"] for flags in (LINEN, NNX)]
  prompt = engines[0]._prefiller.pad(PROMPTS[1])
  programs = []
  for eng in engines:
    params, rng = eng._params(None), jax.random.key(0)
    prefill = compiled_ops(
        eng, eng._prefiller.compiled_one, params, prompt, np.int32(11), rng, None, np.int32(0), num_samples=0
    )
    step = compiled_ops(eng, eng._generate, params, eng.init_decode_state(), rng)
    programs.append((prefill, step))
  for name, linen_ops, nnx_ops in zip(("prefill", "decode step"), *programs):
    assert len(linen_ops) > 100, name
    assert linen_ops == nnx_ops, f"{name}: Linen and NNX compile to different programs"


@pytest.mark.parametrize("batch", [1, 2])
def test_a_decode_step_reads_keys_and_values_where_they_lie_in_the_cache(batch):
  # Stored in the layout the attention products read (`ops.kv_cache`), no layer's cached keys or values are
  # transposed or copied by a decode step; stored token-major, every layer's were, on every step. At batch 1,
  # with the write before the read (`kv_cache.read_first`), XLA copied every layer's keys and values.
  eng = decode("llama-tiny", LINEN)["engine"] if batch == 2 else make_engine("llama-tiny", LINEN, per_device_batch_size=1)
  state = eng.init_decode_state()
  flat = canonical.flatten(state.cache)
  sizes = {leaf.size for path, leaf in flat.items() if path.endswith(("/cached_key", "/cached_value"))}
  moved = []
  for line in compiled_ops(eng, eng._generate, eng._params(None), state, jax.random.key(0)):
    found = re.search(r"= f32\[([\d,]+)\]\S* (transpose|copy)\(", line)
    if found and np.prod([int(d) for d in found.group(1).split(",")]) in sizes:
      moved.append(line.strip())
  assert sizes and not moved, moved[:4]


def test_caches_never_enter_the_parameters_or_the_model():
  for flags in (LINEN, NNX, MIX):
    eng = decode("llama-tiny", flags)["engine"]
    assert not any("cache" in path for path in canonical.flatten(eng.model.params())), flags
    if flags[0]:
      assert not nnx.state(eng.model.module, nnx.Cache), flags


def test_bulk_insert_equals_repeated_insert():
  eng = decode("llama-tiny", LINEN)["engine"]
  prefix = eng.prefill(PROMPTS[0])
  one_by_one = eng.insert(prefix, eng.insert(prefix, eng.init_decode_state(), 0), 1)
  bulk = eng.bulk_insert(prefix, eng.init_decode_state(), [0, 1])
  jax.tree.map(np.testing.assert_array_equal, bulk, one_by_one)


def test_a_slot_reused_for_a_shorter_prompt_forgets_the_longer_one():
  eng = decode("llama-tiny", NNX)["engine"]
  state = eng.insert(eng.prefill(PROMPTS[1]), eng.init_decode_state(), 0)
  state, _ = eng.generate(state)
  state = eng.insert(eng.prefill(PROMPTS[0]), state, 0)
  state, tokens = eng.generate(state)
  assert int(tokens[0]) == int(decode("llama-tiny", NNX)["tokens"][0, 1])


def test_sampling_with_a_fixed_rng_is_reproducible_and_topk_1_is_greedy():
  logits = jax.random.normal(jax.random.key(0), (4, 256))
  greedy = sampling.sample(logits, jax.random.key(1), strategy="greedy")
  for strategy, options in (("topk", dict(top_k=1)), ("nucleus", dict(nucleus_p=1e-6))):
    np.testing.assert_array_equal(sampling.sample(logits, jax.random.key(1), strategy=strategy, **options), greedy)
  draws = [sampling.sample(logits, jax.random.key(s), strategy="weighted", temperature=2.0) for s in (1, 1, 2)]
  np.testing.assert_array_equal(draws[0], draws[1])
  assert not np.array_equal(draws[0], draws[2]) or not np.array_equal(draws[0], greedy)
  top3 = np.argsort(np.asarray(logits), axis=-1)[:, -3:]
  for seed in range(8):
    drawn = np.asarray(sampling.sample(logits, jax.random.key(seed), strategy="topk", top_k=3))
    assert all(token in row for token, row in zip(drawn, top3))


def test_bad_input_is_refused_with_what_would_be_valid():
  eng = decode("llama-tiny", LINEN)["engine"]
  with pytest.raises(ValueError, match="17 tokens, more than max_prefill_predict_length=16"):
    eng.prefill(np.ones(17, np.int32))
  with pytest.raises(ValueError, match="at least one token"):
    eng.prefill(np.zeros(0, np.int32))
  with pytest.raises(ValueError, match=r"token 256 at index 1 is outside the vocabulary \[0, 256\)"):
    eng.prefill(np.array([3, 256, 4]))
  with pytest.raises(ValueError, match=r"true_length=4 must be in \[1, 3\]"):
    eng.prefill(np.array([3, 5, 4]), true_length=4)
  state = eng.init_decode_state()
  with pytest.raises(ValueError, match=r"slot 2 is out of range: this engine has 2 slots, 0..1"):
    eng.insert(decode("llama-tiny", LINEN)["prefixes"][0], state, 2)
  with pytest.raises(ValueError, match="max_prefill_predict_length=32 must be in"):
    engine.Engine(eng.config.replace(max_prefill_predict_length=32), model=eng.model)


def test_model_generate_runs_on_the_cache_and_matches_the_recompute_reference():
  model = decode("qwen3-tiny", NNX)["engine"].model
  prompt = jnp.asarray(np.stack([PROMPTS[0], PROMPTS[1][:5]]), jnp.int32)
  params = model.params()
  for sample, temperature in ((False, 0.0), (True, 0.7)):
    got = model.generate(prompt, 6, temperature=temperature, seed=3)
    want = jax.jit(
        functools.partial(model_lib.generate_by_recompute, model.apply), static_argnames=("max_new_tokens", "sample")
    )(params, prompt, jnp.float32(temperature), jax.random.key(3), max_new_tokens=6, sample=sample)
    if not sample:
      np.testing.assert_array_equal(got, want)
    assert got.shape == (2, 11)


# --- serving features: multisampling, packed prefill, chunked prefill, the stacked prefix cache -------


def visible_entries(cache) -> dict:
  """Each cache leaf where its segment is nonzero (what decoding can read), plus the segments and indices."""
  flat = canonical.flatten(cache)
  out = {}
  for path, leaf in flat.items():
    layer, name = path.rsplit("/", 1)
    segments = np.asarray(flat[f"{layer}/{kv_cache.SEGMENT_IDS}"])
    if name in (kv_cache.SEGMENT_IDS, kv_cache.INDEX):
      out[path] = np.asarray(leaf)
    else:
      lead = segments.ndim - 2  # a stacked cache's layer axis
      shape = [*segments.shape[:-1], *(1,) * (leaf.ndim - segments.ndim)]  # segments [..., B, S] along the entry's
      shape.insert(lead + kv_cache.sequence_axis(name), segments.shape[-1])  # batch and sequence axes
      out[path] = np.where(segments.reshape(shape) != 0, np.asarray(leaf), 0)
  return out


def assert_same_prefix(got, want, atol=1e-5):
  assert int(got.next_pos) == int(want.next_pos)
  np.testing.assert_array_equal(got.token, want.token)
  np.testing.assert_allclose(got.logits, want.logits, atol=atol, rtol=atol)
  got_cache, want_cache = visible_entries(got.cache), visible_entries(want.cache)
  assert sorted(got_cache) == sorted(want_cache)
  for path, leaf in want_cache.items():
    np.testing.assert_allclose(got_cache[path], leaf, atol=atol, err_msg=path)


def test_multisampling_at_temperature_0_repeats_the_greedy_token_and_is_reproducible_when_sampling():
  base = decode("llama-tiny", NNX)["engine"]
  greedy = engine.Engine(base.config.replace(decode_sampling_temperature=0.0), model=base.model)
  prefix = greedy.prefill_multisampling(PROMPTS[0], num_samples=4)
  np.testing.assert_array_equal(prefix.token, np.full(4, decode("llama-tiny", NNX)["tokens"][0, 0]))
  sampler = engine.Engine(
      base.config.replace(decode_sampling_strategy="weighted", decode_sampling_temperature=5.0), model=base.model
  )
  draws = [sampler.prefill_multisampling(PROMPTS[0], num_samples=8, rng=jax.random.key(s)).token for s in (7, 7, 8)]
  np.testing.assert_array_equal(draws[0], draws[1])
  assert len(set(np.asarray(draws[0]).tolist())) > 1  # at temperature 5 the 8 draws differ
  state = greedy.bulk_insert(greedy.prefill_multisampling(PROMPTS[0], num_samples=2), greedy.init_decode_state(), [0, 1])
  np.testing.assert_array_equal(state.tokens, np.asarray(prefix.token[:2]))
  with pytest.raises(ValueError, match="a prefix of 4 samples goes into as many slots"):
    greedy.bulk_insert(prefix, greedy.init_decode_state(), [0, 1])


@pytest.mark.parametrize("preset, flags", [("mistral-tiny", LINEN), ("gemma4-tiny", NNX)], ids=["ring", "kv-shared"])
def test_prefill_concat_splits_into_the_prefixes_of_separate_prefills(preset, flags):
  # gemma4-tiny: its KV-shared layers attend over an earlier layer's packed cache, each prompt its own segment.
  result = decode(preset, flags)
  packed = result["engine"].prefill_concat(PROMPTS)
  assert len(packed) == 2
  for got, want in zip(packed, result["prefixes"]):
    assert_same_prefix(got, want)


@pytest.mark.parametrize("preset, flags", [("mistral-tiny", LINEN), ("deepseek3-tiny", NNX)], ids=["ring", "mla"])
def test_prefill_batch_gives_the_prefixes_of_separate_prefills(preset, flags):
  result = decode(preset, flags)
  batched = result["engine"].prefill_batch(PROMPTS)
  assert len(batched) == 2
  for got, want in zip(batched, result["prefixes"]):
    assert_same_prefix(got, want)
  with pytest.raises(ValueError, match="prefill_batch needs at least one prompt"):
    result["engine"].prefill_batch([])


@pytest.mark.parametrize("flags", [LINEN, NNX])
def test_chunked_prefill_equals_one_shot_prefill(flags):
  eng = decode("deepseek3-tiny", flags)["engine"]
  first = eng.prefill(PROMPTS[1][:6])
  chunked = eng.prefill(PROMPTS[1][6:], existing_prefix=first)
  assert_same_prefix(chunked, decode("deepseek3-tiny", flags)["prefixes"][1])


@pytest.mark.parametrize("scan_layers", [True, False])
def test_stacked_prefix_caches_round_trip_for_both_scan_layers(scan_layers):
  base = decode("llama-tiny", LINEN)["engine"]
  config = base.config.replace(scan_layers=scan_layers, stack_prefill_result_cache=True)
  eng = engine.Engine(config, base.params)
  prefix = eng.prefill(PROMPTS[0])
  unstacked = decode("llama-tiny", LINEN)["prefixes"][0].cache
  # Stacked, whatever scan_layers is: the scanned tree, leaves [layers, 1, ...].
  want = canonical.flatten(canonical.stack_layers(unstacked, axis=0))
  assert sorted(canonical.flatten(prefix.cache)) == sorted(want)
  for path, leaf in canonical.flatten(prefix.cache).items():
    np.testing.assert_allclose(leaf, want[path], atol=1e-6, err_msg=path)
  state = eng.insert(prefix, eng.init_decode_state(), 1)
  for path, leaf in canonical.flatten(state.cache).items():
    np.testing.assert_array_equal(leaf[1:2], canonical.flatten(unstacked)[path], err_msg=path)


@pytest.mark.parametrize("flags", [LINEN, NNX], ids=["linen", "nnx"])
def test_a_scanned_model_decodes_on_the_stacked_cache_tree(flags):
  """The engine unrolls layers; a scanned model's own cached forward (nn.scan / the NNX stack) still works."""
  eng = decode("llama-tiny", flags)["engine"]
  config = eng.config.replace(scan_layers=True)
  model = mb.create_model(config, params=eng.params)
  prompt = jnp.asarray(PROMPTS[0], jnp.int32)[None]
  positions = jnp.arange(prompt.shape[1], dtype=jnp.int32)[None]
  cache = decoding.init_cache(config, 1, 32)
  logits, cache = jax.jit(model.cached_forward)(model.params(), cache, prompt, positions, jnp.ones_like(prompt))
  want = decode("llama-tiny", flags)["prefixes"][0]
  np.testing.assert_allclose(logits[0, -1], want.logits, atol=1e-5, rtol=1e-5)
  stacked = canonical.flatten(canonical.stack_layers(want.cache, axis=0))
  got = canonical.flatten(cache)
  assert sorted(got) == sorted(stacked)
  for path, leaf in visible_entries(cache).items():
    np.testing.assert_allclose(leaf, visible_entries(canonical.unflatten(stacked))[path], atol=1e-5, err_msg=path)


def test_generate_steps_is_repeated_generate_in_one_compiled_loop():
  result = decode("llama-tiny", NNX)
  eng = result["engine"]
  state = eng.insert(result["prefixes"][1], eng.init_decode_state(), 0)
  state = eng.insert(result["prefixes"][0], state, 1)
  state, tokens = eng.generate_steps(state, STEPS)
  assert tokens.shape == (2, STEPS)
  np.testing.assert_array_equal(tokens[::-1], result["tokens"][:, 1:])
  np.testing.assert_allclose(state.logits[::-1], result["logits"][:, -1], atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError, match="num_steps must be a whole number >= 1, got 0"):
    eng.generate_steps(state, 0)


@pytest.mark.parametrize("flags", [LINEN, NNX], ids=["linen", "nnx"])
def test_a_decode_checkpoint_of_a_training_run_loads_straight_into_the_engine(flags, tmp_path):
  """MaxText's generate_param_only_checkpoint: `convert --params-only --scan-layers false --dtype bfloat16`."""
  config = mb.load_config(
      "llama-tiny",
      pure_nnx=flags[0],
      enable_nnx=flags[1],
      pure_nnx_decoder=flags[2],
      steps=2,
      per_device_batch_size=2,
      checkpoint_period=2,
      eval_interval=0,
      max_prefill_predict_length=16,
      max_target_length=32,
      base_output_directory=str(tmp_path),
      run_name="run",
  )
  mb.train(config)
  argv = ["convert", str(tmp_path / "run"), str(tmp_path / "decode"), "--params-only", "--scan-layers", "false"]
  assert cli.main([*argv, "--dtype", "bfloat16"]) == 0
  eng = engine.Engine.from_pretrained(tmp_path / "decode", backend="nnx" if flags[0] else "linen")
  params = canonical.flatten(eng.params)
  assert not any(canonical.is_stacked(path) for path in params)
  assert {leaf.dtype for leaf in params.values()} == {jnp.dtype(jnp.bfloat16)}
  # The training run's own parameters, unscanned and cast to bf16: nothing else changed.
  trained, _ = converters.load_params(tmp_path / "run")
  want = canonical.flatten(canonical.unstack_layers(trained, axis=config.param_scan_axis))
  assert sorted(params) == sorted(want)
  for path, leaf in params.items():
    np.testing.assert_array_equal(leaf, want[path].astype(jnp.bfloat16), err_msg=path)
  state = eng.insert(eng.prefill(PROMPTS[1]), eng.init_decode_state(), 0)
  first = int(state.tokens[0])
  state, tokens = eng.generate_steps(state, 3)
  sequence = np.concatenate([PROMPTS[1], [first], np.asarray(tokens[0, :2])])[None]
  np.testing.assert_array_equal(np.argmax(eng.model.logits(sequence)[0, -4:], axis=-1), [first, *tokens[0]])


def test_bulk_insert_refuses_a_slot_named_twice():
  eng = decode("llama-tiny", NNX)["engine"]
  prefix = eng.prefill_multisampling(PROMPTS[0], num_samples=2)
  with pytest.raises(ValueError, match=r"slots \(0, 0\) name a slot twice"):
    eng.bulk_insert(prefix, eng.init_decode_state(), [0, 0])
