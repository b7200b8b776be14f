"""The engine never decodes past its cache, takes only its own prefixes, and `maxbridge generate` samples as it does."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxbridge as mb
from maxbridge import cli
from maxbridge.core.config import ConfigError
from maxbridge.models import dispatch
from maxbridge.models import model as model_lib
from maxbridge.ops import sampling
from maxbridge.serving import engine
from conftest import LINEN_FLAGS
from test_engine import LINEN, make_engine

LONG, SHORT = np.arange(1, 12), np.array([5, 9, 3, 77, 12])  # 11 and 5 tokens; slots of 32 (make_engine)


@pytest.fixture(scope="module")
def eng() -> engine.Engine:
  return make_engine("llama-tiny", LINEN)


def filled(eng, *prompts):
  state = eng.init_decode_state()
  for slot, prompt in enumerate(prompts):
    state = eng.insert(eng.prefill(prompt), state, slot)
  return state


# --- past the cache: refused before any step runs ---------------------------------------------------------


def test_generate_steps_runs_to_the_last_cache_entry_exactly_and_refuses_one_more(eng):
  state = filled(eng, LONG, SHORT)
  first = np.asarray(state.tokens)
  with pytest.raises(ValueError, match=r"slot 0 is at position 11 and has room for 21 more step\(s\), not 22: .*"):
    eng.generate_steps(state, 22)
  # Refused before the call: the state was not donated, and decoding to the cache's end is still exact.
  state, tokens = eng.generate_steps(state, 21)
  sequence = np.concatenate([LONG, first[:1], np.asarray(tokens[0])])  # 33 tokens: the last is never fed back
  full = np.asarray(eng.model.logits(sequence[None]))[0, len(LONG) - 1 : -1]
  np.testing.assert_array_equal(sequence[len(LONG) :], np.argmax(full, axis=-1))
  assert np.asarray(state.next_pos).tolist() == [32, 26]
  with pytest.raises(ValueError, match=r"slot 0 is at position 32 .* room for 0 more .* max_target_length=32 tokens"):
    eng.generate(state)
  with pytest.raises(ValueError, match=r"slot 0 is at position 32 and has room for 0 more step\(s\), not 5"):
    eng.generate_steps(state, 5)


def test_generate_names_the_slot_that_runs_out_first(eng):
  state = filled(eng, SHORT, LONG)  # the longer prompt in slot 1 this time
  state, _ = eng.generate_steps(state, 21)
  with pytest.raises(ValueError, match=r"slot 1 is at position 32 and has room for 0 more step\(s\), not 1"):
    eng.generate(state)
  # Released, slot 1 is idle and no longer holds the others back; slot 0 decodes on to its own end.
  state = eng.release(state, [1])
  state, _ = eng.generate_steps(state, 6)
  assert np.asarray(state.next_pos).tolist() == [32, 0]
  with pytest.raises(ValueError, match=r"slot 9 is out of range: this engine has 2 slots, 0..1"):
    eng.release(state, [9])


def test_an_idle_slot_stays_at_position_0_and_a_reused_one_decodes_as_new(eng):
  state = filled(eng, SHORT)
  state, _ = eng.generate_steps(state, 20)
  assert np.asarray(state.next_pos).tolist() == [25, 0]  # slot 1 never filled: it never nears its end
  state = eng.insert(eng.prefill(LONG), state, 1)
  state, tokens = eng.generate_steps(eng.release(state, [0]), 21)
  _, fresh = eng.generate_steps(filled(eng, SHORT, LONG), 21)
  np.testing.assert_array_equal(tokens[1], fresh[1])


@pytest.fixture(scope="module")
def ring() -> engine.Engine:
  # mistral-tiny's window (8) fits in max_target_length: its ring holds every entry a token can see.
  return make_engine("mistral-tiny", LINEN, max_target_length=16, max_prefill_predict_length=8)


def test_a_ring_that_holds_its_whole_window_decodes_past_max_target_length_exactly(ring):
  assert ring.position_limit is None
  state = filled(ring, SHORT)
  first = int(state.tokens[0])
  state, tokens = ring.generate_steps(state, 24)  # to position 29, past max_target_length=16
  sequence = np.concatenate([SHORT, [first], np.asarray(tokens[0])])
  full = np.asarray(ring.model.logits(sequence[None]))[0, len(SHORT) - 1 : -1]
  np.testing.assert_array_equal(sequence[len(SHORT) :], np.argmax(full, axis=-1))


@pytest.mark.parametrize(
    "preset, overrides, limit",
    [
        ("llama-tiny", dict(max_target_length=48), 48),
        ("mistral-tiny", dict(max_target_length=32), None),  # window 8: the ring holds it all
        ("mistral-tiny", dict(max_target_length=32, sliding_window_size=64), 32),  # the ring is cut to 32
        ("gpt3-tiny", dict(max_target_length=32), 32),
    ],
)
def test_the_position_limit_is_the_cache_or_the_learned_position_table(preset, overrides, limit):
  assert engine.position_limit(mb.load_config(preset, **overrides)) == limit


def test_a_continuation_past_a_learned_position_table_is_refused_before_decoding():
  config = mb.load_config("gpt3-tiny", **LINEN_FLAGS)  # positions 0..63 learned
  model = dispatch.abstract_model(config)  # refused before any parameter is read
  with pytest.raises(ValueError, match=r"= 67 tokens: trainable_position_size=64, .* ends at 63; .* at most 61 new"):
    engine.generate_continuation(config, model, np.arange(3), 64)


def test_model_generate_sizes_its_cache_to_the_request_past_max_target_length(eng):
  # Model.generate (maxbridge generate's former path, GRPO's rollouts) caches prompt + continuation, not
  # max_target_length: past the trained length it warns and stays exact.
  model, prompt = eng.model, jnp.asarray(np.concatenate([LONG, LONG])[None], jnp.int32)  # 22 + 16 > 32
  with pytest.warns(UserWarning, match="= 38 exceeds max_target_length=32"):
    got = model.generate(prompt, 16)
  want = jax.jit(
      functools.partial(model_lib.generate_by_recompute, model.apply), static_argnames=("max_new_tokens", "sample")
  )(model.params(), prompt, jnp.float32(0), jax.random.key(0), max_new_tokens=16, sample=False)
  np.testing.assert_array_equal(got, want)


# --- a prefix of another engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def longer(eng) -> engine.Engine:
  return engine.Engine(eng.config.replace(max_target_length=48), model=eng.model)


LENGTHS = r"this prefix's cache holds 48 tokens per row and this engine's slots hold 32 \(max_target_length=32\)"


def test_insert_refuses_a_prefix_of_another_max_target_length_naming_both(eng, longer):
  with pytest.raises(ValueError, match=LENGTHS):
    eng.insert(longer.prefill(SHORT), eng.init_decode_state(), 0)
  with pytest.raises(ValueError, match=r"holds 32 tokens per row and this engine's slots hold 48 \(max_target_length=48"):
    longer.insert(eng.prefill(SHORT), longer.init_decode_state(), 1)


def test_bulk_insert_and_chunked_prefill_refuse_a_prefix_of_another_max_target_length(eng, longer):
  with pytest.raises(ValueError, match=LENGTHS):
    eng.bulk_insert(longer.prefill_multisampling(SHORT, num_samples=2), eng.init_decode_state(), [0, 1])
  with pytest.raises(ValueError, match=LENGTHS):
    eng.prefill(SHORT, existing_prefix=longer.prefill(LONG))


def test_a_prefix_of_another_layout_is_refused_naming_what_differs(eng):
  stacked = engine.Engine(eng.config.replace(stack_prefill_result_cache=True), model=eng.model)
  with pytest.raises(ValueError, match=r"not one this engine makes \(missing .*stack_prefill_result_cache"):
    eng.insert(stacked.prefill(SHORT), eng.init_decode_state(), 0)


# --- top_k against the vocabulary -------------------------------------------------------------------------


@pytest.mark.parametrize("top_k", [0, 257])
def test_config_refuses_a_top_k_outside_the_vocabulary(top_k):
  with pytest.raises(ConfigError, match=rf"decode_sampling_top_k .* in \[1, vocab_size=256\], got {top_k}"):
    mb.load_config("llama-tiny", decode_sampling_strategy="topk", decode_sampling_top_k=top_k)


@pytest.mark.parametrize("top_k", [0, 1000])
def test_the_sampler_refuses_a_top_k_outside_the_vocabulary_by_its_key(top_k):
  # A Config (the engine's only way in) cannot hold one; the sampler, called directly, names the key too,
  # where JAX's top_k would not.
  logits = jnp.zeros((2, 256))
  with pytest.raises(ValueError, match=rf"decode_sampling_top_k in \[1, vocab_size=256\], got {top_k}"):
    sampling.sample(logits, jax.random.key(0), strategy="topk", top_k=top_k)


# --- maxbridge generate samples as the engine does ---------------------------------------------------------

PROMPT = "hello"
NEW = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory):
  base = tmp_path_factory.mktemp("run")
  config = mb.load_config(
      "llama-tiny",
      steps=1,
      per_device_batch_size=1,
      eval_interval=0,
      base_output_directory=str(base),
      run_name="run",
      **LINEN_FLAGS,
  )
  mb.train(config, progress=False)
  return base / "run"


def cli_text(run, capsys, *args) -> str:
  argv = ["generate", str(run), "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--backend", "linen", *args]
  assert cli.main(argv) == 0, capsys.readouterr().err
  return capsys.readouterr().out.rstrip("\n")


@functools.lru_cache(maxsize=None)
def engine_text(run, **overrides) -> str:
  """The continuation `mb.Engine` of one slot gives for PROMPT, as the CLI prints it."""
  eng = engine.Engine.from_pretrained(run, backend="linen", per_device_batch_size=1, **overrides)
  prompt = list(PROMPT.encode())
  state = eng.insert(eng.prefill(np.array(prompt)), eng.init_decode_state(), 0)
  first = int(state.tokens[0])
  _, rest = eng.generate_steps(state, NEW - 1)
  return bytes([*prompt, first, *np.asarray(rest[0]).tolist()]).decode("utf-8", errors="replace")


SAMPLING = {
    "greedy": dict(decode_sampling_strategy="greedy"),
    "weighted": dict(decode_sampling_strategy="weighted", decode_sampling_temperature=2.0),
    "topk": dict(decode_sampling_strategy="topk", decode_sampling_top_k=20, decode_sampling_temperature=1.5),
    "nucleus": dict(decode_sampling_strategy="nucleus", decode_sampling_nucleus_p=0.9, seed=3),
}


@pytest.mark.parametrize("strategy", SAMPLING)
def test_generate_samples_by_the_decode_sampling_keys_as_the_engine_does(run, capsys, strategy):
  keys = SAMPLING[strategy]
  got = cli_text(run, capsys, *(f"{key}={value}" for key, value in keys.items()))
  assert got == engine_text(run, **keys)
  if strategy != "greedy":  # a barely trained model is near uniform: a sampled continuation is not the greedy one
    assert got != engine_text(run, **SAMPLING["greedy"])


def test_generate_topk_1_is_greedy_and_its_flags_set_the_same_keys(run, capsys):
  greedy = cli_text(run, capsys)
  assert cli_text(run, capsys, "decode_sampling_strategy=topk", "decode_sampling_top_k=1") == greedy
  # --temperature T samples (weighted) at T, --seed seeds it: the keys decode_sampling_temperature and seed.
  sampled = cli_text(run, capsys, "--temperature", "2", "--seed", "5")
  assert sampled == engine_text(run, decode_sampling_strategy="weighted", decode_sampling_temperature=2.0, seed=5)
  assert sampled != greedy
  assert cli_text(run, capsys, "--temperature", "0", "decode_sampling_strategy=weighted") == greedy


@pytest.mark.parametrize(
    "keys, match",
    [
        (["decode_sampling_strategy=topk", "decode_sampling_top_k=0"], r"in \[1, vocab_size=256\], got 0"),
        (["decode_sampling_strategy=topk", "decode_sampling_top_k=300"], r"in \[1, vocab_size=256\], got 300"),
        (
            ["decode_sampling_strategy=weighted", "decode_sampling_temperature=0"],
            "decode_sampling_temperature, which is 0",
        ),
    ],
)
def test_generate_refuses_sampling_keys_the_engine_cannot_use(run, capsys, keys, match):
  assert cli.main(["generate", str(run), "--prompt", PROMPT, "--backend", "linen", *keys]) == 2
  assert re.search(match, capsys.readouterr().err)


def test_an_engine_on_a_run_refuses_a_top_k_past_the_vocabulary(run):
  with pytest.raises(ConfigError, match=r"decode_sampling_top_k .* in \[1, vocab_size=256\], got 300"):
    engine.Engine.from_pretrained(run, backend="linen", decode_sampling_strategy="topk", decode_sampling_top_k=300)


def test_a_state_made_outside_the_engine_is_checked_on_its_own_positions(eng):
  # The engine keeps the positions of the states it makes on the host; any other state is read.
  state = filled(eng, SHORT)._replace(next_pos=jnp.asarray([32, 0], jnp.int32))
  with pytest.raises(ValueError, match=r"slot 0 is at position 32 and has room for 0 more step\(s\), not 1"):
    eng.generate(state)
