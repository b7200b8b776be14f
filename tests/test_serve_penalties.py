"""OpenAI's logit_bias, presence_penalty and frequency_penalty through `maxbridge serve`, against a hand loop.

The hand loop steps an `mb.Engine` of the served config one token at a time,
reads the model's logits each step, applies the bias and the penalties itself
(by the counts of the tokens it chose so far) and takes the argmax: what OpenAI
defines and the server must reproduce, token for token, on both backends.
"""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxbridge.interop import pretrained
from maxbridge.models import dispatch
from maxbridge.ops import sampling
from maxbridge.serving import engine as engine_lib
import served
from served import MODEL

openai = pytest.importorskip("openai")

OVERRIDES = ["per_device_batch_size=4", "max_target_length=64", "max_prefill_predict_length=32"]
BACKEND_OVERRIDES = {"linen": [], "nnx": ["quantize_kvcache=true"]}  # as test_serve's servers
PROMPT = "w5 w9 w200"
STEPS = 10


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  return served.write_folder(tmp_path_factory.mktemp("penalties"))


@pytest.fixture(scope="module", params=["linen", "nnx"])
def served_model(request, folder):
  """(the server's openai client, an engine of the same config for the hand loop)."""
  backend = request.param
  server = served.Server(folder, backend, *OVERRIDES, *BACKEND_OVERRIDES[backend])
  client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
  flags = pretrained.backend_overrides(backend)
  config, params = pretrained.load_pretrained(folder, *OVERRIDES, *BACKEND_OVERRIDES[backend], **flags)
  model = dispatch.create_model(config, params=params)
  yield client, engine_lib.Engine(model.config, model=model)
  server.stop()


def hand_greedy(engine, prompt: list[int], steps: int, presence=0.0, frequency=0.0, bias=None):
  """(tokens, the model's log-probability of each) of greedy decoding with OpenAI's bias and penalties applied
  by hand to the logits the engine's model gives after each chosen token."""
  prefix = engine.prefill(np.int32(prompt))
  logits = np.asarray(prefix.logits, np.float32)
  counts = np.zeros_like(logits)
  state, tokens, logprobs = engine.init_decode_state(), [], []
  for step in range(steps):
    adjusted = logits - presence * (counts > 0) - frequency * counts
    for token, value in (bias or {}).items():
      adjusted[token] += value
    first, second = np.sort(adjusted)[::-1][:2]
    assert first - second > 1e-3, f"step {step}: a near tie ({first} vs {second}) would make the reference ambiguous"
    token = int(np.argmax(adjusted))
    tokens.append(token)
    logprobs.append(float(jax.nn.log_softmax(logits)[token]))
    counts[token] += 1
    if step == 0:
      state = engine.insert(prefix._replace(token=jnp.int32(token)), state, 0)
    else:  # the engine's own greedy choice replaced by ours
      state = state._replace(tokens=state.tokens.at[0].set(token))
    state, _ = engine.generate(state)
    logits = np.asarray(state.logits[0], np.float32)
  return tokens, logprobs


def served_tokens(client, prompt=PROMPT, steps=STEPS, **fields) -> list[int]:
  text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=steps, temperature=0, **fields).choices[0].text
  return [int(word[1:]) for word in text.split()]


def test_penalize_rows_against_numpy():
  rng = np.random.default_rng(0)
  logits, counts = rng.normal(size=(3, 16)).astype(np.float32), rng.integers(0, 3, (3, 16)).astype(np.int32)
  presence, frequency = np.float32([0.5, 0, -2]), np.float32([1.5, 0, 0.25])
  ids, values = np.int32([[3, 7], [0, 0], [15, 3]]), np.float32([[100, -4], [0, 0], [2, -100]])
  got = np.asarray(jax.jit(sampling.penalize_rows)(logits, counts, presence, frequency, ids, values))
  want = logits - presence[:, None] * (counts > 0) - frequency[:, None] * counts
  for row in range(3):
    for token, value in zip(ids[row], values[row]):
      want[row, token] += value
  np.testing.assert_allclose(got, want, rtol=1e-6)
  nothing = np.asarray(sampling.penalize_rows(logits, counts, presence * 0, frequency * 0, ids, values * 0))
  np.testing.assert_array_equal(nothing, logits)  # all at 0: the logits as they were, bit for bit
  first = np.asarray(sampling.penalize_rows(logits, None, presence, frequency, ids, values))  # no tokens yet
  np.testing.assert_allclose(first, want + presence[:, None] * (counts > 0) + frequency[:, None] * counts, rtol=1e-6)


def test_a_logit_bias_of_100_chooses_its_token_every_step(served_model):
  client, engine = served_model
  assert served_tokens(client, logit_bias={"77": 100}) == [77] * STEPS
  sampled = client.completions.create(
      model=MODEL, prompt=PROMPT, max_tokens=STEPS, temperature=1, seed=3, logit_bias={"77": 100}
  )
  assert sampled.choices[0].text == " ".join(["w77"] * STEPS)
  plain, _ = hand_greedy(engine, [5, 9, 200], STEPS)
  assert served_tokens(client) == plain
  bias = {plain[0]: -100.0, 31: 2.5, 140: -1.0}  # greedy's first choice ruled out, two others moved
  want, _ = hand_greedy(engine, [5, 9, 200], STEPS, bias=bias)
  assert want[0] != plain[0]
  assert served_tokens(client, logit_bias={str(k): v for k, v in bias.items()}) == want


# A bias of 3 makes greedy repeat token 12 every step; the penalties, counted from the tokens generated so far,
# break the run after one, two or four of them. Without a bias the random model never repeats in 10 steps: a
# negative penalty makes it.
CASES = {
    "frequency": (0.0, 1.0, {12: 3.0}),
    "presence": (2.0, 0.0, {12: 3.0}),
    "both": (-1.5, 0.75, {12: 3.0}),
    "negative": (0.0, -1.0, {}),
}


@pytest.mark.parametrize("case", CASES)
def test_penalties_equal_the_hand_loop(served_model, case):
  client, engine = served_model
  presence, frequency, bias = CASES[case]
  want, raw_logprobs = hand_greedy(engine, [5, 9, 200], STEPS, presence, frequency, bias)
  assert want != hand_greedy(engine, [5, 9, 200], STEPS, bias=bias)[0], "the penalty should change this run"
  fields = dict(presence_penalty=presence, frequency_penalty=frequency, logit_bias={str(k): v for k, v in bias.items()})
  assert served_tokens(client, **fields) == want
  # The logprobs are the model's, before bias and penalties (vLLM's default, logprobs_mode="raw_logprobs").
  choice = client.completions.create(
      model=MODEL, prompt=PROMPT, max_tokens=STEPS, temperature=0, logprobs=1, **fields
  ).choices[0]
  np.testing.assert_allclose(choice.logprobs.token_logprobs, raw_logprobs, atol=1e-5)
  # The chat endpoint: its template renders the messages as "w1 {content} w2 w3".
  chat = client.chat.completions.create(
      model=MODEL, messages=[{"role": "user", "content": "w40 w41"}], max_tokens=STEPS, temperature=0, **fields
  )
  words = chat.choices[0].message.content.split()
  assert [int(w[1:]) for w in words] == hand_greedy(engine, [1, 40, 41, 2, 3], STEPS, presence, frequency, bias)[0]


def test_each_slot_counts_its_own_tokens_and_starts_afresh(served_model):
  client, engine = served_model
  plain, _ = hand_greedy(engine, [5, 9, 200], STEPS)
  penalized, _ = hand_greedy(engine, [5, 9, 200], STEPS, 0.0, 1.0, {12: 3.0})
  penalty = {"frequency_penalty": 1.0, "logit_bias": {"12": 3.0}}
  asks = [{}, penalty] * 3  # side by side in one engine's slots
  with concurrent.futures.ThreadPoolExecutor(len(asks)) as pool:
    got = list(pool.map(lambda fields: served_tokens(client, **fields), asks))
  assert got == [plain, penalized] * 3
  # Again, into slots that held penalized requests: their counts start from zero.
  assert [served_tokens(client, **penalty) for _ in range(2)] == [penalized] * 2
  assert served_tokens(client) == plain


def test_out_of_range_penalties_and_bias_get_400_naming_the_field(served_model):
  client, _ = served_model
  ask = dict(model=MODEL, prompt=PROMPT, max_tokens=2)
  for fields, param, message in [
      ({"logit_bias": {"256": 1}}, "logit_bias", r"logit_bias: token id 256 is outside the vocabulary \[0, 256\)"),
      ({"logit_bias": {"-1": 1}}, "logit_bias", "logit_bias: token id -1 is outside"),
      ({"logit_bias": {"w5": 1}}, "logit_bias", "logit_bias: key 'w5' is not a token id"),
      ({"logit_bias": {"5": 100.5}}, "logit_bias.5", "logit_bias.5: Input should be less than or equal to 100"),
      ({"logit_bias": {"5": -101}}, "logit_bias.5", "logit_bias.5: Input should be greater than or equal to -100"),
      ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias", "logit_bias: Dictionary should have at most 300"),
      ({"presence_penalty": 2.5}, "presence_penalty", "presence_penalty: Input should be less than or equal to 2"),
      ({"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty: Input should be greater than or equal to -2"),
      ({"best_of": 3}, "best_of", "best_of: not supported by this server"),
  ]:
    with pytest.raises(openai.BadRequestError, match=message) as refused:
      client.completions.create(**ask, **fields)
    assert refused.value.body["param"] == param
  with pytest.raises(openai.BadRequestError, match="presence_penalty: Input should be less than or equal to 2"):
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w5"}], presence_penalty=2.01)
  # At their defaults, or a bias of 0, they ask for nothing: greedy's own tokens.
  defaults = dict(logit_bias={"7": 0}, presence_penalty=0, frequency_penalty=0.0, best_of=1)
  assert served_tokens(client, **defaults) == served_tokens(client)
