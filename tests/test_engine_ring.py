"""Sliding-window layers decode on a ring of `window` cache entries and still equal the full forward."""

import functools

import numpy as np
import pytest

from maxbridge.core import canonical
from maxbridge.ops import kv_cache
from maxbridge.models import decoding
from test_engine import LINEN, NNX, make_engine

WINDOW = 8  # mistral-tiny's sliding_window_size
# The longer prompt is over one window (its prefill chunk wraps the ring), and both
# decode past twice the window: every ring entry is overwritten at least twice.
PROMPTS = (np.arange(3, 16), np.array([5, 9, 3, 77, 12]))
STEPS = 14


@functools.lru_cache(maxsize=None)
def ring_decode(flags) -> dict:
  eng = make_engine("mistral-tiny", flags, max_target_length=40)
  state = eng.init_decode_state()
  for slot, prompt in enumerate(PROMPTS):
    state = eng.insert(eng.prefill(prompt), state, slot)
  tokens, logits = [np.asarray(state.tokens)], [np.asarray(state.logits)]
  for _ in range(STEPS):
    state, new = eng.generate(state)
    tokens.append(np.asarray(new))
    logits.append(np.asarray(state.logits))
  return dict(engine=eng, state=state, tokens=np.stack(tokens, axis=1), logits=np.stack(logits, axis=1))


def full_forward(eng, prompt, continuation) -> np.ndarray:
  """The full (uncached) forward's logits at each position that predicted `continuation`."""
  sequence = np.concatenate([prompt, continuation])[None]
  return np.asarray(eng.model.logits(sequence))[0, len(prompt) - 1 : -1]


@pytest.mark.parametrize("flags", [LINEN, NNX], ids=["linen", "nnx"])
def test_decoding_past_twice_the_window_on_the_ring_is_the_full_forward_in_two_slots(flags):
  result = ring_decode(flags)
  for slot, prompt in enumerate(PROMPTS):
    assert len(prompt) + STEPS > 2 * WINDOW
    full = full_forward(result["engine"], prompt, result["tokens"][slot])
    np.testing.assert_array_equal(result["tokens"][slot], np.argmax(full, axis=-1), err_msg=f"slot {slot}")
    np.testing.assert_allclose(result["logits"][slot], full, atol=1e-5, rtol=1e-5, err_msg=f"slot {slot}")


def test_ring_decoding_is_bit_identical_on_linen_and_nnx():
  linen, nnx_ = ring_decode(LINEN), ring_decode(NNX)
  np.testing.assert_array_equal(linen["tokens"], nnx_["tokens"])
  np.testing.assert_array_equal(linen["logits"], nnx_["logits"])
  want, got = canonical.flatten(linen["state"].cache), canonical.flatten(nnx_["state"].cache)
  assert sorted(want) == sorted(got)
  for path, leaf in want.items():
    np.testing.assert_array_equal(got[path], leaf, err_msg=path)


def test_a_windowed_layer_caches_window_entries_per_row():
  eng = ring_decode(LINEN)["engine"]

  def rows_and_entries(path, leaf):
    name = path.rsplit("/", 1)[1]
    return (leaf.shape[0],) if name == "cache_index" else (leaf.shape[0], leaf.shape[kv_cache.sequence_axis(name)])

  for path, leaf in canonical.flatten(ring_decode(LINEN)["state"].cache).items():
    if not path.endswith("cache_index"):
      assert rows_and_entries(path, leaf) == (2, WINDOW), path
  # However long the rows, and the same tree (names, shapes, dtypes) on both backends.
  for path, leaf in canonical.flatten(decoding.abstract_cache(eng.config, 1, 4096)).items():
    assert rows_and_entries(path, leaf) == ((1,) if path.endswith("cache_index") else (1, WINDOW)), path


@pytest.mark.parametrize("flags", [LINEN, NNX], ids=["linen", "nnx"])
def test_chunked_prefill_over_the_ring_equals_one_shot_and_decodes_on(flags):
  result = ring_decode(flags)
  eng, prompt = result["engine"], PROMPTS[0]
  # A first chunk longer than the window, then one that wraps the ring again.
  first = eng.prefill(prompt[:10])
  chunked = eng.prefill(prompt[10:], existing_prefix=first)
  assert int(chunked.next_pos) == len(prompt)
  np.testing.assert_array_equal(chunked.token, result["tokens"][0, 0])
  np.testing.assert_allclose(chunked.logits, result["logits"][0, 0], atol=1e-5, rtol=1e-5)
  state, tokens = eng.generate_steps(eng.insert(chunked, eng.init_decode_state(), 1), 4)
  np.testing.assert_array_equal(tokens[1], result["tokens"][0, 1:5])


def test_packed_prefill_of_more_than_a_window_gives_each_prompt_its_own_ring():
  eng = ring_decode(NNX)["engine"]
  prompts = (PROMPTS[1], PROMPTS[0][:11])  # 16 tokens packed: two windows

  def decoded(prefixes):
    state = eng.init_decode_state()
    for slot, prefix in enumerate(prefixes):
      state = eng.insert(prefix, state, slot)
    return eng.generate_steps(state, 4)

  packed_state, packed = decoded(eng.prefill_concat(prompts))
  alone_state, alone = decoded([eng.prefill(prompt) for prompt in prompts])
  np.testing.assert_array_equal(packed, alone)
  np.testing.assert_allclose(packed_state.logits, alone_state.logits, atol=1e-5, rtol=1e-5)


def test_model_generate_on_a_ring_matches_the_recompute_reference():
  model = ring_decode(LINEN)["engine"].model
  prompt = np.stack([PROMPTS[0][:5], PROMPTS[1]]).astype(np.int32)
  got = np.asarray(model.generate(prompt, 20))
  for row in range(2):
    full = full_forward(ring_decode(LINEN)["engine"], prompt[row], got[row, 5:])
    np.testing.assert_array_equal(got[row, 5:], np.argmax(full, axis=-1))
