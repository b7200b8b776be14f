"""`maxbridge serve` as a user runs it: a real server subprocess per backend, driven by the official `openai` client.

The model and its word-level tokenizer are `served.write_folder`'s. The tests of
a failing decode loop serve in this process instead, over an engine whose steps
fail when told to.
"""

import concurrent.futures
import http.client
import json
import re
import signal
import socket
import threading
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest

from maxbridge import cli
from maxbridge.interop import pretrained
from maxbridge.models import dispatch
from maxbridge.ops import sampling
from maxbridge.serving import codec as codec_lib
from maxbridge.serving import engine as engine_lib
from maxbridge.serving import scheduler as sched
from maxbridge.serving import server as server_lib
import served
from served import MODEL, TEMPLATE, get as _get

openai = pytest.importorskip("openai")

SLOTS = 4
QUEUE = 12
OVERRIDES = [f"per_device_batch_size={SLOTS}", "max_target_length=64", "max_prefill_predict_length=32"]
# The NNX server also stores its KV cache int8: `maxbridge generate` gets the same keys, so greedy still agrees.
BACKEND_OVERRIDES = {"linen": [], "nnx": ["quantize_kvcache=true"]}
PROMPTS = ["w5 w9 w200", "w17", "w3 w3 w3 w3 w44", "w250 w1 w7"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
  return served.write_folder(tmp_path_factory.mktemp("serve"))


class Server(served.Server):
  """The served model, its official `openai` client and what /metrics and /health say."""

  def __init__(self, folder, backend: str):
    args = ["--max-queue", str(QUEUE), "--shutdown-timeout", "10", *OVERRIDES, *BACKEND_OVERRIDES[backend]]
    super().__init__(folder, backend, *args)
    self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=60)

  def metric(self, name: str) -> float:
    text = _get(self.url + "/metrics")[1]
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE))

  def busy(self) -> int:
    return json.loads(_get(self.url + "/health")[1])["slots_busy"]


@pytest.fixture(scope="module", params=["linen", "nnx"])
def server(request, folder):
  server = Server(folder, request.param)
  server.backend = request.param
  yield server
  server.stop()


def _generate(folder, backend: str, prompt: str, new_tokens: int, capsys) -> str:
  """What `maxbridge generate` prints after the prompt."""
  capsys.readouterr()
  argv = ["generate", str(folder), "--prompt", prompt, "--max-new-tokens", str(new_tokens), "--backend", backend]
  assert cli.main([*argv, *OVERRIDES, *BACKEND_OVERRIDES[backend]]) == 0
  out = capsys.readouterr().out.strip()
  assert out.startswith(prompt)
  return out[len(prompt) :].strip()


def test_each_row_samples_by_its_own_settings():
  logits = jax.random.normal(jax.random.key(0), (5, 256)) * 3
  keys = jax.random.split(jax.random.key(1), 5)
  greedy = np.argmax(logits, axis=-1)
  top3 = np.argsort(-logits, axis=-1)[:, :3]
  draw = jax.jit(lambda keys, t, k, p: sampling.sample_rows(logits, keys, t, k, p))
  # Rows: greedy; top_k=1; a tiny top_p; top_k=3; everything (temperature 1).
  t, k, p = np.float32([0, 1, 1, 1, 1]), np.int32([0, 1, 0, 3, 0]), np.float32([1, 1, 1e-6, 1, 1])
  seen = np.stack([np.asarray(draw(jax.random.split(jax.random.key(i), 5), t, k, p)) for i in range(64)])
  np.testing.assert_array_equal(seen[:, :3], np.broadcast_to(greedy[:3], (64, 3)))
  assert set(seen[:, 3]) <= set(top3[3]) and len(set(seen[:, 3])) > 1
  assert len(set(seen[:, 4])) > 3
  assert np.asarray(draw(keys, np.zeros(5, np.float32), k, p)).tolist() == greedy.tolist()  # all greedy: no sort


def test_greedy_completion_equals_generate_streamed_or_not(server, folder, capsys):
  for prompt in PROMPTS[:1]:  # one: each `maxbridge generate` builds and compiles an engine of its own
    want = _generate(folder, server.backend, prompt, 16, capsys)
    whole = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    assert whole.choices[0].text.strip() == want
    assert whole.choices[0].finish_reason == "length" and whole.usage.completion_tokens == 16
    chunks = list(server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True))
    assert len(chunks) == 17  # one per token, then the finish
    assert "".join(c.choices[0].text for c in chunks).strip() == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_renders_the_folders_template(server, folder, capsys):
  messages = [{"role": "user", "content": "w8 w9"}]
  want = _generate(folder, server.backend, "w1 w8 w9 w2 w3", 8, capsys)
  whole = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
  assert whole.choices[0].message.content.strip() == want and whole.choices[0].message.role == "assistant"
  stream = server.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True)
  chunks = list(stream)
  assert chunks[0].choices[0].delta.role == "assistant"
  assert "".join(c.choices[0].delta.content or "" for c in chunks).strip() == want


def test_chat_content_parts_render_as_the_joined_text_and_other_parts_are_refused_by_name(server):
  """OpenAI's content parts: text parts join with newlines (vLLM's rendering), so they answer as the one string
  does; an image part on this text-only model, an unknown part type and a resolution hint are refused naming them."""
  client = server.client

  def chat(content, **kwargs):
    messages = [{"role": "user", "content": content}]
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0, **kwargs)

  parts = [{"type": "text", "text": "w8 w9"}, {"type": "text", "text": "w40"}]
  assert chat(parts).choices[0].message.content == chat("w8 w9 w40").choices[0].message.content
  image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
  with pytest.raises(openai.BadRequestError, match=r"messages\.0\.content\.1: an image_url part, but this model has no"):
    chat([parts[0], image])
  with pytest.raises(openai.BadRequestError, match="input_audio.*'text', 'image_url'"):
    chat([parts[0], {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])
  with pytest.raises(openai.BadRequestError, match=r"messages\.0\.content\.1\.image_url\.detail"):
    chat([parts[0], {"type": "image_url", "image_url": {"url": "data:image/png;base64,", "detail": "low"}}])


def test_n_stop_seed_and_logprobs(server):
  client = server.client
  two = client.completions.create(model=MODEL, prompt="w4 w5", max_tokens=6, temperature=1.0, n=2, seed=7)
  assert [c.index for c in two.choices] == [0, 1] and all(len(c.text.split()) == 6 for c in two.choices)
  again = client.completions.create(model=MODEL, prompt="w4 w5", max_tokens=6, temperature=1.0, n=2, seed=7)
  assert [c.text for c in again.choices] == [c.text for c in two.choices]  # a seeded request repeats
  greedy = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0).choices[0].text
  words = greedy.split()
  cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=10, temperature=0, stop=[words[3]])
  assert cut.choices[0].finish_reason == "stop"
  assert cut.choices[0].text.split() == words[: words.index(words[3])]
  scored = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0, logprobs=2)
  lp = scored.choices[0].logprobs
  assert lp.tokens == words[:3] and len(lp.top_logprobs) == 3
  # Greedy: the token drawn is the most likely one, and its log-probability the top one.
  assert all(
      max(top, key=top.get) == tok and abs(top[tok] - v) < 1e-5
      for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)
  )


def test_sixteen_concurrent_streams_share_decode_steps(server):
  client = server.client
  want = {
      p: client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0).choices[0].text for p in PROMPTS
  }
  before = server.metric("maxbridge_slot_occupancy_count") - server.metric('maxbridge_slot_occupancy_bucket{le="1.5"}')

  def one(i):
    prompt = PROMPTS[i % len(PROMPTS)]
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stream=True)
    return prompt, "".join(c.choices[0].text for c in stream)

  with concurrent.futures.ThreadPoolExecutor(16) as pool:
    results = list(pool.map(one, range(16)))
  assert [text for _, text in results] == [want[p] for p, _ in results]
  shared = server.metric("maxbridge_slot_occupancy_count") - server.metric('maxbridge_slot_occupancy_bucket{le="1.5"}')
  assert shared - before > 0  # decode steps that ran more than one request at once
  assert server.busy() == 0


def test_a_client_that_disconnects_mid_stream_frees_its_slot(server):
  connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
  body = json.dumps({"prompt": "w5", "max_tokens": 60, "temperature": 0, "stream": True})
  connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
  response = connection.getresponse()
  assert response.status == 200
  response.fp.readline()  # the first token's chunk
  connection.sock.shutdown(socket.SHUT_RDWR)
  connection.close()
  deadline = time.monotonic() + 10
  while server.busy() and time.monotonic() < deadline:
    time.sleep(0.05)
  assert server.busy() == 0


def test_a_full_queue_answers_429_with_retry_after(server):
  body = json.dumps({"prompt": "w5", "max_tokens": 60, "temperature": 0}).encode()

  def post(_):
    request = urllib.request.Request(server.url + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
      with urllib.request.urlopen(request, timeout=60) as response:
        return response.status, None
    except urllib.error.HTTPError as e:
      return e.code, e.headers.get("Retry-After")

  with concurrent.futures.ThreadPoolExecutor(SLOTS + QUEUE + 8) as pool:
    answers = list(pool.map(post, range(SLOTS + QUEUE + 8)))
  refused = [retry for status, retry in answers if status == 429]
  assert refused and all(retry == "1" for retry in refused)
  assert {status for status, _ in answers} == {200, 429}
  assert answers.count((200, None)) >= SLOTS + QUEUE


def test_bad_requests_get_400_naming_the_field(server):
  client = server.client
  with pytest.raises(openai.BadRequestError, match="max_tokens"):
    client.completions.create(model=MODEL, prompt="w5", max_tokens="many")
  with pytest.raises(openai.BadRequestError, match="temperature"):
    client.completions.create(model=MODEL, prompt="w5", temperature="hot")
  with pytest.raises(openai.BadRequestError, match="max_prefill_predict_length=32"):
    client.completions.create(model=MODEL, prompt=" ".join(["w5"] * 40), max_tokens=2)
  with pytest.raises(openai.BadRequestError, match="max_target_length=64"):
    client.completions.create(model=MODEL, prompt="w5", max_tokens=80)
  # Unknown fields are ignored, as OpenAI does.
  ok = client.completions.create(model=MODEL, prompt="w5", max_tokens=2, temperature=0, extra_body={"frobnicate": 1})
  assert ok.usage.completion_tokens == 2
  assert [m.id for m in client.models.list().data] == ["llama-tiny-hf"]


def _post(url: str, body: bytes | dict, path: str = "/v1/completions") -> tuple[int, dict]:
  """POST as it is sent, for bodies the openai client would not send (its JSON refuses NaN) or routes it does not
  know (vLLM's /tokenize); (status, JSON)."""
  body = json.dumps(body).encode() if isinstance(body, dict) else body
  request = urllib.request.Request(url + path, body, {"Content-Type": "application/json"})
  try:
    with urllib.request.urlopen(request, timeout=60) as response:
      return response.status, json.loads(response.read())
  except urllib.error.HTTPError as e:
    return e.code, json.loads(e.read())


def test_out_of_range_fields_and_huge_bodies_get_4xx_and_the_server_goes_on(server):
  client = server.client
  greedy = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
  want = client.completions.create(**greedy).choices[0].text
  # top_k 2**40 once passed and overflowed int32 in the decode loop, which died: every later request hung.
  with pytest.raises(openai.BadRequestError, match="top_k=1099511627776: at most vocab_size=256"):
    client.completions.create(**greedy, extra_body={"top_k": 2**40})
  with pytest.raises(openai.BadRequestError, match="temperature"):
    client.completions.create(**{**greedy, "temperature": 1e30})
  with pytest.raises(openai.BadRequestError, match="'other' is not served here; this server serves 'llama-tiny-hf'"):
    client.completions.create(**{**greedy, "model": "other"})
  for field, literal in [("temperature", "NaN"), ("top_p", "Infinity"), ("temperature", "-Infinity"), ("top_p", "1e999")]:
    status, answer = _post(server.url, f'{{"prompt": "w5", "max_tokens": 2, "{field}": {literal}}}'.encode())
    assert (status, answer["error"]["param"]) == (400, field), f"{field}: {literal} got {status} {answer}"
    assert answer["error"]["message"].startswith(f"{field}: "), answer
  status, answer = _post(server.url, b'{"prompt": "w5", "max_tokens": ')
  assert status == 400 and answer["error"]["param"] is None, answer
  assert answer["error"]["message"].startswith("the body is not JSON"), answer
  with pytest.raises(openai.APIStatusError, match="more than this server's limit of 8388608") as refused:
    client.completions.create(**{**greedy, "prompt": "w5 " * (7 * 2**20)})  # 21 MiB
  assert refused.value.status_code == 413
  status, answer = _get(server.url + "/v1/no-such-route")
  assert status == 404 and json.loads(answer)["error"]["type"] == "not_found_error", answer
  assert client.completions.create(**greedy).choices[0].text == want
  assert _get(server.url + "/health")[0] == 200


def test_tokenize_and_detokenize_as_vllm(server):
  # vLLM's tokenizer endpoints over the completions' own tokenizer: equal ids give equal greedy continuations.
  status, out = _post(server.url, {"model": MODEL, "prompt": PROMPTS[2]}, "/tokenize")
  assert (status, out) == (200, {"count": 5, "max_model_len": 64, "tokens": [3, 3, 3, 3, 44], "token_strs": None})
  by_text = server.client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=4, temperature=0)
  by_ids = server.client.completions.create(model=MODEL, prompt=out["tokens"], max_tokens=4, temperature=0)
  assert by_ids.choices[0].text == by_text.choices[0].text and by_ids.usage.prompt_tokens == out["count"]
  assert _post(server.url, {"tokens": out["tokens"]}, "/detokenize") == (200, {"prompt": PROMPTS[2]})
  named = _post(server.url, {"prompt": PROMPTS[2], "return_token_strs": True}, "/tokenize")[1]
  assert named["token_strs"] == PROMPTS[2].split()  # each id's string in the vocabulary
  chat = {"messages": [{"role": "user", "content": "w8 w9"}]}
  assert _post(server.url, chat, "/tokenize")[1]["tokens"] == [1, 8, 9, 2, 3]  # TEMPLATE, as the chat renders it
  assert _post(server.url, {**chat, "add_generation_prompt": False}, "/tokenize")[1]["tokens"] == [1, 8, 9, 2]
  status, info = _get(server.url + "/tokenizer_info")
  # The special tokens are named though the folder sets none: lm-evaluation-harness takes the server's
  # tokenizer only when /tokenizer_info has an eos_token key.
  want = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE, "bos_token": None, "eos_token": None}
  assert (status, json.loads(info)) == (200, want)
  for path, body in [("/tokenize", {"prompt": "w5"}), ("/detokenize", {"tokens": [5]})]:
    status, answer = _post(server.url, {**body, "model": "other"}, path)
    assert (status, answer["error"]["param"]) == (400, "model"), answer
    assert "'other' is not served here; this server serves 'llama-tiny-hf'" in answer["error"]["message"]
  status, answer = _post(server.url, {"tokens": [5, 256, -1]}, "/detokenize")
  assert (status, answer["error"]["param"]) == (400, "tokens"), answer
  assert answer["error"]["message"] == "tokens: token id 256 (at index 1) is outside the vocabulary [0, 256)"
  for body, field in [({"prompt": "w5", "messages": chat["messages"]}, "prompt"), ({"tokens": ["w5"]}, "tokens.0")]:
    status, answer = _post(server.url, body, "/tokenize" if "prompt" in body else "/detokenize")
    assert (status, answer["error"]["param"]) == (400, field), answer


def test_echo_scores_the_prompt_with_the_models_own_logits(server, folder):
  # What lm-evaluation-harness sends to score a multiple-choice answer: the prompt echoed with its logprobs.
  client, text, tokens = server.client, "w5 w9 w200 w17 w3", [5, 9, 200, 17, 3]
  scored = client.completions.create(model=MODEL, prompt=text, max_tokens=0, echo=True, logprobs=2)
  (choice,) = scored.choices
  assert (choice.text, choice.finish_reason, scored.usage.completion_tokens) == (text, "length", 0)
  lp = choice.logprobs
  assert lp.tokens == text.split() and lp.text_offset == [0, 2, 4, 8, 11]
  assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing comes before the first token
  flags = pretrained.backend_overrides(server.backend)
  config, params = pretrained.load_pretrained(folder, *OVERRIDES, *BACKEND_OVERRIDES[server.backend], **flags)
  logits = dispatch.create_model(config, params=params).logits(np.int32([tokens]))[0, :-1]
  want = np.asarray(jax.nn.log_softmax(logits.astype(np.float32), axis=-1))
  np.testing.assert_allclose(lp.token_logprobs[1:], want[np.arange(4), tokens[1:]], atol=1e-5)
  for row, top in zip(want, lp.top_logprobs[1:]):
    best = np.argsort(-row)[:2]
    assert list(top) == [f"w{t}" for t in best]
    np.testing.assert_allclose(list(top.values()), row[best], atol=1e-5)
  # With tokens to generate, the completion's come after the prompt's: text and logprobs.
  plain = client.completions.create(model=MODEL, prompt=text, max_tokens=3, temperature=0, logprobs=1).choices[0]
  both = client.completions.create(model=MODEL, prompt=tokens, max_tokens=3, temperature=0, logprobs=1, echo=True, n=2)
  echoed = both.choices[0]
  assert both.choices[1].text == echoed.text and both.choices[1].logprobs.tokens == echoed.logprobs.tokens
  assert echoed.text == text + plain.text
  assert echoed.logprobs.tokens == text.split() + plain.logprobs.tokens
  np.testing.assert_allclose(echoed.logprobs.token_logprobs[1:5], lp.token_logprobs[1:], atol=1e-5)
  np.testing.assert_allclose(echoed.logprobs.token_logprobs[5:], plain.logprobs.token_logprobs, atol=1e-5)
  assert echoed.logprobs.text_offset[5:] == [len(text) + o for o in plain.logprobs.text_offset]
  with pytest.raises(openai.BadRequestError, match="echo: not with stream"):
    client.completions.create(model=MODEL, prompt=text, max_tokens=2, echo=True, stream=True)
  with pytest.raises(openai.BadRequestError, match="max_tokens: 0 generates nothing"):
    client.completions.create(model=MODEL, prompt=text, max_tokens=0)


def test_several_prompts_as_text_or_token_ids(server):
  client = server.client
  greedy = {
      p: client.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0).choices[0].text
      for p in PROMPTS[:2]
  }
  for prompt in [PROMPTS[:2], [[5, 9, 200], [17]]]:
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]  # prompt i's choice j is i * n + j
    assert [c.text for c in out.choices] == [greedy[PROMPTS[0]]] * 2 + [greedy[PROMPTS[1]]] * 2
    assert out.usage.prompt_tokens == 4 and out.usage.completion_tokens == 12
  stream = client.completions.create(model=MODEL, prompt=PROMPTS[:2], max_tokens=3, temperature=0, stream=True)
  texts = ["", ""]
  for chunk in stream:
    texts[chunk.choices[0].index] += chunk.choices[0].text
  assert texts == [greedy[PROMPTS[0]], greedy[PROMPTS[1]]]
  with pytest.raises(openai.BadRequestError, match=r"prompt.1: token id 300 \(at index 1\) is outside the vocabulary"):
    client.completions.create(model=MODEL, prompt=[[5], [17, 300]], max_tokens=2)
  with pytest.raises(openai.BadRequestError, match=r"prompt: token id -1 \(at index 0\)"):
    client.completions.create(model=MODEL, prompt=[-1, 5], max_tokens=2)
  assert server.busy() == 0


def test_sigterm_finishes_what_is_in_flight_and_exits_0(server):
  # The module's last test on each server: it ends it.
  stream = server.client.completions.create(model=MODEL, prompt="w5", max_tokens=40, temperature=0, stream=True)
  first = next(iter(stream))
  server.process.send_signal(signal.SIGTERM)
  rest = list(stream)
  assert first.choices[0].finish_reason is None
  assert rest[-1].choices[0].finish_reason == "length" and len(rest) + 1 == 41
  assert server.process.wait(timeout=30) == 0
  with pytest.raises(openai.APIConnectionError):
    server.client.completions.create(model=MODEL, prompt="w5", max_tokens=2)


def test_a_port_out_of_range_or_in_use_is_refused_before_the_banner(folder, capsys):
  with pytest.raises(SystemExit) as refused:
    cli.main(["serve", str(folder), "--port", "70000"])
  assert refused.value.code == 2 and "--port: '70000' is not a TCP port (0..65535)" in capsys.readouterr().err
  with socket.socket() as taken:
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    assert cli.main(["serve", str(folder), "--port", str(port)]) == 2
  out, err = capsys.readouterr()
  assert f"cannot listen on 127.0.0.1:{port}" in err and "maxbridge serve:" not in out, (out, err)


def test_a_media_directory_for_a_text_only_model_is_refused_before_the_banner(folder, tmp_path, capsys):
  assert cli.main(["serve", str(folder), "--port", "0", "--allowed-local-media-path", str(tmp_path)]) == 2
  out, err = capsys.readouterr()
  assert "this model takes no images (use_multimodal=false)" in err and "maxbridge serve:" not in out, (out, err)


class FailingEngine:
  """The real engine, but for `generate`: its next `failing` steps raise. `build_app`'s engine is the seam."""

  def __init__(self, engine: engine_lib.Engine):
    self.engine, self.failing = engine, 0

  def __getattr__(self, name):
    return getattr(self.engine, name)

  def generate(self, state, **kwargs):
    if self.failing:
      self.failing -= 1
      raise RuntimeError("a decode step failed on purpose")
    return self.engine.generate(state, **kwargs)


@pytest.fixture(scope="module")
def failing(folder):
  """(openai client, FailingEngine, the server's thread and what it raised): `serve` in this process, linen."""
  config, params = pretrained.load_pretrained(folder, *OVERRIDES, **pretrained.backend_overrides("linen"))
  model = dispatch.create_model(config, params=params)
  engine = FailingEngine(engine_lib.Engine(model.config, model=model))
  text = pretrained.TextTokenizer(pretrained.load_tokenizer(folder, config.vocab_size), folder)
  codec = codec_lib.Codec.from_folder(text.encode, text.decode, folder)
  sock = server_lib.bind("127.0.0.1", 0)
  url, raised = f"http://127.0.0.1:{sock.getsockname()[1]}", []

  def serve():
    try:
      server_lib.serve(engine, codec, sock=sock, model_name=MODEL, shutdown_timeout=5)
    except RuntimeError as e:
      raised.append(e)

  thread = threading.Thread(target=serve, daemon=True)  # the last test ends it; else it ends with the tests
  thread.start()
  deadline = time.monotonic() + 60
  while time.monotonic() < deadline:
    try:
      if _get(url + "/health")[0] == 200:
        break
    except OSError:
      time.sleep(0.1)
  client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
  return client, engine, thread, raised, url


def test_a_failed_decode_step_answers_500_and_the_loop_starts_again(failing):
  client, engine, _, _, url = failing
  greedy = dict(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0)
  want = client.completions.create(**greedy).choices[0].text
  engine.failing = 1
  with pytest.raises(openai.InternalServerError, match="the decode loop failed: RuntimeError: a decode step failed"):
    client.completions.create(**greedy)
  engine.failing = 1
  with pytest.raises(openai.APIError, match="the decode loop failed: RuntimeError: a decode step failed"):
    list(client.completions.create(**greedy, stream=True))  # the stream ends with an error event
  assert client.completions.create(**greedy).choices[0].text == want
  assert _get(url + "/health")[0] == 200


def test_a_decode_loop_that_keeps_failing_gives_up_and_ends_the_server(failing):
  # The module's last test on this server: it ends it.
  client, engine, thread, raised, url = failing
  engine.failing = sched.MAX_FAILURES
  for _ in range(sched.MAX_FAILURES):
    with pytest.raises(openai.InternalServerError, match="a decode step failed"):
      client.completions.create(model=MODEL, prompt="w5", max_tokens=4)
  thread.join(timeout=30)
  assert not thread.is_alive() and "failed 3 times in a row" in str(raised[0])
