"""`maxbridge serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over `mb.Engine`'s decode slots.

Endpoints: POST /v1/completions and /v1/chat/completions (streamed as
server-sent events, one chunk per token, or whole), GET /v1/models, /health
and /metrics (Prometheus text), and vLLM's tokenizer endpoints: POST /tokenize
and /detokenize, GET /tokenizer_info (over the tokenizer the completions use). One thread owns the engine
(`scheduler.Scheduler`: continuous batching); the event loop only validates,
queues and relays (tokenizing and chat templates run on worker threads).

No request can stop it. A body over `max_request_bytes` answers 413; a full
queue 429 with Retry-After; a prompt that does not fit the cache 400 naming
the limit; a field of the wrong type, or out of its range (NaN and infinity
included), 400 naming the field; another `model` than the served one 400
naming it; unknown fields are ignored, as OpenAI does. Every error is JSON in
OpenAI's shape, and a stream that fails ends with an error event. If the
decode loop fails, the requests in flight get 500 with the reason and the loop
starts again; failing again and again it gives up and the server exits 1. A
client that goes away cancels its request and frees its slots. SIGTERM stops
admitting, lets requests in flight finish for `shutdown_timeout` seconds,
answers the rest 503 and exits 0.
"""

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import secrets
import socket
import threading
import time
import uuid

import fastapi
import prometheus_client
import uvicorn
from fastapi import responses
from starlette import exceptions as starlette_exceptions

from maxbridge.serving import chat_content
from maxbridge.serving import codec as codec_lib
from maxbridge.serving import engine as engine_lib
from maxbridge.serving import metrics as metrics_lib
from maxbridge.serving import openai_api as api
from maxbridge.serving import scheduler as sched

log = logging.getLogger(__name__)


def build_app(
    engine: engine_lib.Engine,
    codec: codec_lib.Codec,
    *,
    model_name: str,
    max_queue: int = 64,
    max_request_bytes: int = api.MAX_REQUEST_BYTES,
    images: chat_content.ImageSources = chat_content.NO_IMAGE_SOURCES,
) -> tuple[fastapi.FastAPI, sched.Scheduler]:
  """The FastAPI app and its scheduler (started with the app, stopped with it); `images`: where a model with a
  vision tower reads its image processor and the files image parts may name."""
  metrics = metrics_lib.Metrics(engine.max_concurrent_decodes)
  scheduler = sched.Scheduler(engine, codec.decode, eos_ids=codec.eos_ids, max_queue=max_queue, metrics=metrics)
  vision = chat_content.Vision.of(engine.config, images)
  routes = _Routes(engine, codec, scheduler, metrics, model_name, vision)

  @contextlib.asynccontextmanager
  async def lifespan(app):
    scheduler.start()
    yield
    scheduler.stop(app.state.shutdown_timeout)

  app = fastapi.FastAPI(title="maxbridge", lifespan=lifespan)
  app.state.shutdown_timeout = 30.0
  app.add_middleware(api.BodyLimit, limit=max_request_bytes)
  app.exception_handler(fastapi.exceptions.RequestValidationError)(routes.invalid)
  app.exception_handler(api.Refusal)(routes.refused)
  app.exception_handler(starlette_exceptions.HTTPException)(routes.http_error)  # 404, 405: JSON as the rest
  app.exception_handler(Exception)(routes.failed)
  app.post("/v1/completions")(routes.completions)
  app.post("/v1/chat/completions")(routes.chat)
  app.get("/v1/models")(routes.models)
  app.post("/tokenize")(routes.tokenize)
  app.post("/detokenize")(routes.detokenize)
  app.get("/tokenizer_info")(routes.tokenizer_info)
  app.get("/health")(routes.health)
  app.get("/metrics")(routes.metrics_text)
  return app, scheduler


class _Routes:
  """The app's routes, a method each, over what they share: the engine, its scheduler and metrics, the codec.

  The routes carry no docstrings: FastAPI would publish them in /openapi.json.
  """

  def __init__(
      self,
      engine: engine_lib.Engine,
      codec: codec_lib.Codec,
      scheduler: sched.Scheduler,
      metrics: metrics_lib.Metrics,
      model_name: str,
      vision: chat_content.Vision | None = None,
  ):
    self.engine, self.codec, self.scheduler, self.metrics, self.model_name = engine, codec, scheduler, metrics, model_name
    self.vision = vision
    self.config = engine.config
    self.limit = engine.position_limit or self.config.max_target_length
    self.template = codec_lib.chat_template(codec.chat_template)

  async def invalid(self, request, exc):
    first = exc.errors()[0]
    self.metrics.requests.labels(request.url.path, "400").inc()
    if first["type"] == "json_invalid":  # its loc is ("body", character offset): no field to name
      where = first["loc"][-1]
      return api.error_response(
          400, f"the body is not JSON: {first.get('ctx', {}).get('error', first['msg'])} at character {where}"
      )
    field, problem = api.invalid_field(exc.errors())
    return api.error_response(400, f"{field}: {problem}", field)

  async def refused(self, request, exc: api.Refusal):
    self.metrics.requests.labels(request.url.path, str(exc.status)).inc()
    return api.error_response(exc.status, exc.message, exc.param, exc.headers)

  async def http_error(self, request, exc):
    self.metrics.requests.labels(request.url.path, str(exc.status_code)).inc()
    return api.error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", headers=exc.headers)

  async def failed(self, request, exc):
    self.metrics.requests.labels(request.url.path, "500").inc()
    return api.error_response(500, f"internal error: {type(exc).__name__}: {exc}")

  async def completions(self, body: api.CompletionBody, request: fastapi.Request):
    codec = self.codec
    self._check_model(body)
    if body.echo and body.stream:  # the prompt's scores would come before any token: not a stream's shape
      raise api.Refusal(400, "echo: not with stream: true; ask for the whole completion", "echo")
    if body.max_tokens == 0 and not body.echo:
      raise api.Refusal(400, "max_tokens: 0 generates nothing; it is for echo: true (scoring the prompt)", "max_tokens")
    prompts = await asyncio.to_thread(self._completion_prompts, body.prompt)
    params = [self._sampling(body, prompt, body.max_tokens, 16, body.logprobs) for prompt in prompts]
    n, endpoint = body.n, "/v1/completions"
    rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}

    def logprobs(event):
      if event.logprob is None:
        return None
      return {
          "tokens": [codec.decode([event.token])],
          "token_logprobs": [event.logprob],
          "top_logprobs": [{codec.decode([t]): v for t, v in event.top}],
          "text_offset": [0],
      }

    if body.stream:
      events = await self._run(request, prompts, params, endpoint)

      async def chunks():
        async for event in events:
          if isinstance(event, sched.TokenEvent):
            choice = {"index": event.index, "text": event.text, "logprobs": logprobs(event), "finish_reason": None}
          else:
            choice = {"index": event.index, "text": event.text, "logprobs": None, "finish_reason": event.reason}
          yield {**head, "choices": [choice]}

      return _sse(chunks())
    # Choice i * n + j is prompt i's j-th; with echo it starts with the prompt (and its scores).
    choices = [{"index": c, "text": "", "logprobs": None, "finish_reason": "length"} for c in range(n * len(prompts))]
    if body.echo:
      echoes = await asyncio.to_thread(self._echoes, body.prompt, prompts, body.logprobs)
      for choice in choices:
        text, scored = echoes[choice["index"] // n]
        # Each choice its own lists: its completion's logprobs are appended to them.
        choice["text"], choice["logprobs"] = text, scored and {key: list(v) for key, v in scored.items()}
    counts = [0] * len(choices)
    if body.max_tokens != 0:
      for event in await _whole(request, await self._run(request, prompts, params, endpoint)):
        choice = choices[event.index]
        choice["text"] += event.text
        if isinstance(event, sched.TokenEvent):
          counts[event.index] += 1
          if event.logprob is not None:
            lp = choice["logprobs"] or {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            one = logprobs(event)
            for key in ("tokens", "token_logprobs", "top_logprobs"):
              lp[key] += one[key]
            lp["text_offset"].append(len(choice["text"]) - len(event.text))
            choice["logprobs"] = lp
        else:
          choice["finish_reason"] = event.reason
    asked = sum(map(len, prompts))
    usage = {"prompt_tokens": asked, "completion_tokens": sum(counts), "total_tokens": asked + sum(counts)}
    return {**head, "choices": choices, "usage": usage}

  async def chat(self, body: api.ChatBody, request: fastapi.Request):
    codec = self.codec
    self._check_model(body)
    prompt, images = await asyncio.to_thread(self._chat_prompt, body.messages)
    k = (body.top_logprobs or 0) if body.logprobs else None
    params = self._sampling(body, prompt, body.max_completion_tokens or body.max_tokens, None, k)
    events = await self._run(request, [prompt], [params], "/v1/chat/completions", images)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    head = {"id": rid, "object": "chat.completion", "created": created, "model": self.model_name}

    def content_logprobs(event):
      def one(token, value):
        piece = codec.decode([token])
        return {"token": piece, "logprob": value, "bytes": list(piece.encode("utf-8"))}

      top = [one(t, v) for t, v in event.top]
      return {**one(event.token, event.logprob), "top_logprobs": top}

    if body.stream:

      async def chunks():
        started = set()
        async for event in events:
          delta = {"content": event.text}
          if event.index not in started:
            started.add(event.index)
            delta["role"] = "assistant"
          choice = {"index": event.index, "delta": delta, "logprobs": None, "finish_reason": None}
          if isinstance(event, sched.TokenEvent):
            if event.logprob is not None:
              choice["logprobs"] = {"content": [content_logprobs(event)]}
          else:
            choice["finish_reason"] = event.reason
          yield {**head, "object": "chat.completion.chunk", "choices": [choice]}

      return _sse(chunks())
    out = await _whole(request, events)
    texts, reasons, lps, counts = [""] * params.n, [None] * params.n, [[] for _ in range(params.n)], [0] * params.n
    for event in out:
      texts[event.index] += event.text
      if isinstance(event, sched.TokenEvent):
        counts[event.index] += 1
        if event.logprob is not None:
          lps[event.index].append(content_logprobs(event))
      else:
        reasons[event.index] = event.reason
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": texts[i]},
            "logprobs": {"content": lps[i]} if params.logprobs is not None else None,
            "finish_reason": reasons[i],
        }
        for i in range(params.n)
    ]
    usage = {"prompt_tokens": len(prompt), "completion_tokens": sum(counts), "total_tokens": len(prompt) + sum(counts)}
    return {**head, "choices": choices, "usage": usage}

  async def models(self):
    card = {"id": self.model_name, "object": "model", "created": 0, "owned_by": "maxbridge", "max_model_len": self.limit}
    return {"object": "list", "data": [card]}

  # vLLM's tokenizer endpoints, on the codec the completions use: /tokenize's tokens are what they would feed.

  async def tokenize(self, body: api.TokenizeBody):
    self._check_model(body)
    if (body.prompt is None) == (body.messages is None):
      raise api.Refusal(400, "give either prompt (text) or messages (a chat), not both or neither", "prompt")
    if body.return_token_strs and self.codec.token_strs is None:
      raise api.Refusal(400, "return_token_strs: this server's codec has no token strings", "return_token_strs")
    tokens = await asyncio.to_thread(self._tokenize, body)
    strs = self.codec.token_strs(tokens) if body.return_token_strs else None
    return {"count": len(tokens), "max_model_len": self.limit, "tokens": tokens, "token_strs": strs}

  async def detokenize(self, body: api.DetokenizeBody):
    self._check_model(body)
    return {"prompt": await asyncio.to_thread(self._detokenize, body.tokens)}

  async def tokenizer_info(self):
    return self.codec.tokenizer_info()

  async def health(self):
    if self.scheduler.error is not None:
      return api.error_response(503, f"the decode loop failed: {self.scheduler.error}")
    return {"status": "ok", "slots": self.engine.max_concurrent_decodes, "slots_busy": self.scheduler.busy_slots}

  async def metrics_text(self):
    return responses.Response(prometheus_client.generate_latest(self.metrics.registry), media_type="text/plain")

  def _check_model(self, body: api.Strict) -> None:
    if body.model is not None and body.model != self.model_name:
      raise api.Refusal(400, f"model: {body.model!r} is not served here; this server serves {self.model_name!r}", "model")
    field = body.unsupported() if isinstance(body, api.Body) else None
    if field is not None:
      raise api.Refusal(400, f"{field}: not supported by this server; leave it out (or at its default)", field)

  # The prompt's tokens, made on a worker thread: a long text must not hold up every other request's events.

  def _completion_prompt(self, prompt: str | list[int], field: str = "prompt") -> list[int]:
    if isinstance(prompt, str):
      return self.codec.encode(prompt)
    self._check_ids(prompt, field)
    return list(prompt)

  def _completion_prompts(self, prompt) -> list[list[int]]:
    """The token ids of each prompt a completion gives: one text or id list, or a list of them."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
      return [self._completion_prompt(prompt)]
    if not prompt:
      raise api.Refusal(400, "the prompt is empty: give at least one token", "prompt")
    return [self._completion_prompt(p, f"prompt.{i}") for i, p in enumerate(prompt)]

  def _echoes(self, given, prompts: list[list[int]], k: int | None) -> list[tuple[str, dict | None]]:
    """Each prompt's echo: its text (as given, or its ids decoded) and, with logprobs, its tokens' scores by the
    served model (one forward pass each, on this worker thread)."""
    texts = [given] if isinstance(given, str) else given if isinstance(given[0], str) else [None] * len(prompts)
    out = []
    for text, tokens in zip(texts, prompts):
      text = self.codec.decode(tokens) if text is None else text
      scores = None if k is None else self.engine.score_prompt(tokens, min(sched.MAX_LOGPROBS, self.config.vocab_size))
      out.append((text, None if scores is None else _prompt_logprobs(self.codec.decode, tokens, scores, k)))
    return out

  def _tokenize(self, body: api.TokenizeBody) -> list[int]:
    if body.prompt is not None:  # lm-evaluation-harness encodes a context and its continuation without specials
      return self.codec.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    # A rendered chat is encoded as the chat endpoint feeds it, specials added: refused, unless the tokenizer adds
    # none, rather than answered with tokens the caller asked to be without.
    if not body.add_special_tokens and self.codec.encode(""):
      raise api.Refusal(
          400,
          f"add_special_tokens: this server's tokenizer adds {self.codec.encode('')} to a chat (as the chat "
          "endpoint encodes it); send add_special_tokens true with messages",
          "add_special_tokens",
      )
    return self._chat_prompt(body.messages, body.add_generation_prompt, read_images=False)[0]

  def _detokenize(self, tokens: list[int]) -> str:
    self._check_ids(tokens, "tokens")
    return self.codec.decode(tokens)

  def _check_ids(self, tokens: list[int], field: str) -> None:
    vocab = self.config.vocab_size
    bad = next((i for i, t in enumerate(tokens) if not 0 <= t < vocab), None)
    if bad is not None:
      raise api.Refusal(
          400, f"{field}: token id {tokens[bad]} (at index {bad}) is outside the vocabulary [0, {vocab})", field
      )

  def _logit_bias(self, bias: dict[str, float]) -> tuple[tuple[int, float], ...]:
    """`logit_bias` as (token id, bias) pairs; its values' range and size are checked by `api.Body`."""
    pairs = {}
    for key, value in bias.items():
      try:
        token = int(key)
      except ValueError:
        raise api.Refusal(400, f"logit_bias: key {key!r} is not a token id", "logit_bias") from None
      if not 0 <= token < self.config.vocab_size:
        raise api.Refusal(
            400,
            f"logit_bias: token id {token} is outside the vocabulary [0, {self.config.vocab_size})",
            "logit_bias",
        )
      pairs[token] = value  # "7" and "07" name one token: the later wins, as a JSON object's repeated key
    return tuple(pairs.items())

  def _chat_prompt(self, messages: list[api.Message], add_generation_prompt: bool = True, read_images: bool = True):
    args = (self.template, self.codec, messages, self.vision)
    return chat_content.chat_prompt(*args, add_generation_prompt=add_generation_prompt, read_images=read_images)

  def _sampling(self, body: api.Body, prompt: list[int], max_tokens: int | None, default_tokens: int | None, logprobs):
    config, limit, slots = self.config, self.limit, self.engine.max_concurrent_decodes
    if len(prompt) == 0:
      raise api.Refusal(400, "the prompt is empty: give at least one token", "prompt")
    if len(prompt) > config.max_prefill_predict_length:
      raise api.Refusal(
          400,
          f"the prompt has {len(prompt)} tokens, more than max_prefill_predict_length="
          f"{config.max_prefill_predict_length}, the longest this server prefills",
          "prompt",
      )
    room = limit - len(prompt)
    max_tokens = (default_tokens or room) if max_tokens is None else max_tokens
    if max_tokens > room:
      raise api.Refusal(
          400,
          f"the prompt ({len(prompt)} tokens) and max_tokens={max_tokens} pass max_target_length={limit}, the "
          f"tokens a slot's cache holds: ask for at most {room} new tokens",
          "max_tokens",
      )
    if body.n > slots:
      raise api.Refusal(400, f"n={body.n}: this server has {slots} decode slots", "n")
    if body.top_k > config.vocab_size:  # past it every token is kept anyway; int32 on the device
      raise api.Refusal(
          400, f"top_k={body.top_k}: at most vocab_size={config.vocab_size} (0 or -1: every token)", "top_k"
      )
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    return sched.SamplingParams(
        max_tokens=max_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=max(body.top_k, 0),
        n=body.n,
        seed=secrets.randbits(32) if body.seed is None else body.seed % 2**32,
        stop=tuple(s for s in stop if s),
        logprobs=logprobs,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=self._logit_bias(body.logit_bias or {}),
    )

  async def _run(
      self,
      request: fastapi.Request,
      prompts: list[list[int]],
      params: list[sched.SamplingParams],
      endpoint: str,
      images=None,
  ):
    """Queues one request a prompt (`images`: the one prompt's, a chat's); yields the scheduler's events (prompt i's
    choice j as index i * n + j) until every choice finishes; cancels them all if abandoned."""
    scheduler = self.scheduler
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()

    def emitter(offset: int):
      def emit(event):
        event = dataclasses.replace(event, index=event.index + offset) if offset else event
        loop.call_soon_threadsafe(events.put_nowait, event)

      return emit

    jobs = [sched.Request(prompt, p, emitter(i * p.n), images) for i, (prompt, p) in enumerate(zip(prompts, params))]
    try:
      for job in jobs:
        scheduler.submit(job)
    except (sched.QueueFull, sched.Draining) as e:
      for job in jobs:  # all or none: the ones queued already would run for nobody
        scheduler.cancel(job)
      if isinstance(e, sched.QueueFull):
        raise api.Refusal(429, f"{e}; retry later", headers={"Retry-After": "1"}) from e
      raise api.Refusal(503, str(e)) from e
    # Counted when queued: the status line of a stream is sent before its end (a failure is counted again).
    self.metrics.requests.labels(endpoint, "200").inc()

    async def stream():
      left = sum(p.n for p in params)
      try:
        while left:
          event = await events.get()
          if isinstance(event, sched.FinishEvent):
            if event.reason == "cancelled":
              return
            if event.reason in ("error", "shutdown"):
              status = 500 if event.reason == "error" else 503
              self.metrics.requests.labels(endpoint, str(status)).inc()
              raise api.Refusal(status, event.message)
            left -= 1
          yield event
      finally:
        if left:
          for job in jobs:
            scheduler.cancel(job)

    return stream()


def _prompt_logprobs(decode, tokens: list[int], scores, k: int) -> dict:
  """An echoed prompt's `logprobs`, as vLLM's: each token with its log-probability after the ones before it and
  the k likeliest there; the first token has none (nothing comes before it). `scores`: `Engine.score_prompt`'s.
  text_offset counts the characters of the tokens before, as vLLM's."""
  chosen, values, ids = scores
  pieces = [decode([t]) for t in tokens]
  top = [{decode([t]): v for t, v in zip(ids[i, :k].tolist(), values[i, :k].tolist())} for i in range(len(chosen))]
  return {
      "tokens": pieces,
      "token_logprobs": [None, *chosen.tolist()],
      "top_logprobs": [None, *top],
      "text_offset": list(itertools.accumulate(map(len, pieces[:-1]), initial=0)),
  }


async def _whole(request: fastapi.Request, events):
  """All of a request's events, cancelling it when the client disconnects before they are in."""
  out = []
  task = asyncio.ensure_future(_collect(events, out))
  while not task.done():
    await asyncio.wait([task], timeout=0.25)
    if not task.done() and await request.is_disconnected():
      task.cancel()  # raises in the event stream, whose `finally` cancels the request
      with contextlib.suppress(asyncio.CancelledError):
        await task
      raise api.Refusal(499, "client disconnected")
  task.result()
  return out


def _sse(chunks):
  async def body():
    # The status line went out with the first chunk: a failure after it ends the stream with an error event, as
    # vLLM's do (the openai client raises it).
    try:
      async for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    except api.Refusal as e:
      yield f"data: {json.dumps(api.error_body(e.status, e.message, e.param))}\n\n"
    except Exception as e:  # pylint: disable=broad-exception-caught
      log.exception("a stream failed")
      yield f"data: {json.dumps(api.error_body(500, f'internal error: {type(e).__name__}: {e}'))}\n\n"
    yield "data: [DONE]\n\n"

  return responses.StreamingResponse(body(), media_type="text/event-stream")


async def _collect(events, out: list) -> None:
  async for event in events:
    out.append(event)


class _Server(uvicorn.Server):
  """uvicorn's server, whose SIGTERM/SIGINT stop the scheduler admitting and end the process with status 0.

  Requests still running `shutdown_timeout` s after the signal are answered 503 by the scheduler (streams end
  with an error event); uvicorn, given a few seconds more, would cut them with a plain-text 500. A decode loop
  that gave up ends the server too.
  """

  def __init__(self, config: uvicorn.Config, scheduler: sched.Scheduler, shutdown_timeout: float):
    super().__init__(config)
    self.scheduler, self.shutdown_timeout = scheduler, shutdown_timeout

  def handle_exit(self, sig, frame) -> None:
    if not self.should_exit:
      self.scheduler.drain()
      message = f"the server shut down before this request finished (--shutdown-timeout {self.shutdown_timeout:g} s)"
      timer = threading.Timer(self.shutdown_timeout, self.scheduler.abort, (message,))
      timer.daemon = True
      timer.start()
    super().handle_exit(sig, frame)

  async def on_tick(self, counter: int) -> bool:
    return self.scheduler.error is not None or await super().on_tick(counter)

  @contextlib.contextmanager
  def capture_signals(self):
    # uvicorn raises a captured signal again once it has shut down; a drained server has done what the signal
    # asked, so it exits 0 instead of dying of it.
    with super().capture_signals():
      yield
      self._captured_signals.clear()


def bind(host: str, port: int) -> socket.socket:
  """A socket bound to host:port (as uvicorn binds: SO_REUSEADDR), or OSError saying why not, before anything
  claims the server is up."""
  if not 0 <= port <= 65535:
    raise ValueError(f"port {port} is not a TCP port (0..65535)")
  sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
  sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  try:
    sock.bind((host, port))
  except OSError as e:
    sock.close()
    raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror} (is another server there?)") from None
  return sock


def serve(
    engine: engine_lib.Engine,
    codec: codec_lib.Codec,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    sock: socket.socket | None = None,
    model_name: str = "maxbridge",
    max_queue: int = 64,
    max_request_bytes: int = api.MAX_REQUEST_BYTES,
    shutdown_timeout: float = 30.0,
    images: chat_content.ImageSources = chat_content.NO_IMAGE_SOURCES,
) -> None:
  """Serves `engine` on `sock` (else host:port) until SIGTERM or SIGINT; returns after a graceful shutdown,
  raises RuntimeError if the decode loop gave up."""
  app, scheduler = build_app(
      engine,
      codec,
      model_name=model_name,
      max_queue=max_queue,
      max_request_bytes=max_request_bytes,
      images=images,
  )
  app.state.shutdown_timeout = shutdown_timeout
  sock = sock or bind(host, port)
  grace = shutdown_timeout + 5.0  # uvicorn's own cut comes after the scheduler's answers
  config = uvicorn.Config(app, timeout_graceful_shutdown=grace, log_level="warning")
  _Server(config, scheduler, shutdown_timeout).run(sockets=[sock])
  if scheduler.error is not None:
    raise RuntimeError(f"the decode loop failed {sched.MAX_FAILURES} times in a row: {scheduler.error}")
