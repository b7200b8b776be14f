"""`maxbridge serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn) over `mb.Engine`'s decode slots.

Endpoints: POST /v1/completions and /v1/chat/completions (streamed as
server-sent events, one chunk per token, or whole), GET /v1/models, /health
and /metrics (Prometheus text). One thread owns the engine
(`scheduler.Scheduler`: continuous batching); the event loop only validates,
queues and relays. A full queue answers 429 with Retry-After, a prompt that
does not fit the cache 400 naming the limit, a field of the wrong type 400
naming the field; unknown fields are ignored, as OpenAI does. A client that
goes away cancels its request and frees its slots. SIGTERM stops admitting,
lets requests in flight finish for `shutdown_timeout` seconds, cancels the
rest and exits 0.
"""

import asyncio
import contextlib
import dataclasses
import json
import logging
import secrets
import time
import uuid
from pathlib import Path
from typing import Callable

import fastapi
import jinja2.sandbox
import prometheus_client
import pydantic
import uvicorn
from fastapi import responses

from maxbridge.serving import engine as engine_lib
from maxbridge.serving import scheduler as sched

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Codec:
  """Text <-> tokens for the server: the model's tokenizer (or bytes), its end-of-sequence ids and chat template."""

  encode: Callable[[str], list[int]]
  decode: Callable[[list[int]], str]
  eos_ids: tuple[int, ...] = ()
  chat_template: str | None = None
  special_tokens: dict[str, str] = dataclasses.field(default_factory=dict)  # bos_token, eos_token for the template

  @classmethod
  def from_folder(cls, encode, decode, folder: Path) -> "Codec":
    """With the chat template and special tokens of `folder`'s tokenizer_config.json and the end-of-sequence ids
    of its generation_config.json or config.json, as Hugging Face folders hold them (each optional)."""

    def read(name: str) -> dict:
      path = folder / name
      try:
        return json.loads(path.read_text()) if path.is_file() else {}
      except (OSError, ValueError) as e:
        raise ValueError(f"{path} is not readable JSON: {e}") from e

    settings = read("tokenizer_config.json")
    template = settings.get("chat_template")
    if isinstance(template, list):  # named templates: the default one
      template = next((t["template"] for t in template if t.get("name") == "default"), None)
    special = {}
    for key in ("bos_token", "eos_token"):
      value = settings.get(key)
      special[key] = value.get("content", "") if isinstance(value, dict) else (value or "")
    eos = read("generation_config.json").get("eos_token_id", read("config.json").get("eos_token_id"))
    eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (eos,)
    return cls(encode, decode, eos, template, special)


class _Body(pydantic.BaseModel):
  """Fields both endpoints share; strict, so a wrong type is refused rather than coerced. Unknown fields are ignored."""

  model_config = pydantic.ConfigDict(strict=True, extra="ignore")
  model: str | None = None
  max_tokens: int | None = pydantic.Field(default=None, ge=1)
  temperature: float = pydantic.Field(default=1.0, ge=0)
  top_p: float = pydantic.Field(default=1.0, gt=0, le=1)
  top_k: int = pydantic.Field(default=0, ge=-1)  # an extension, as vLLM's; 0 or -1: every token
  n: int = pydantic.Field(default=1, ge=1)
  stop: str | list[str] | None = None
  seed: int | None = None
  stream: bool = False


class CompletionBody(_Body):
  prompt: str | list[int]
  logprobs: int | None = pydantic.Field(default=None, ge=0, le=sched.MAX_LOGPROBS)


class _Message(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(strict=True, extra="allow")
  role: str
  content: str


class ChatBody(_Body):
  messages: list[_Message] = pydantic.Field(min_length=1)
  max_completion_tokens: int | None = pydantic.Field(default=None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = pydantic.Field(default=None, ge=0, le=sched.MAX_LOGPROBS)


class _Error(Exception):

  def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.headers = status, message, param, headers


def _error(status: int, message: str, param: str | None = None, headers: dict | None = None):
  kind = {400: "invalid_request_error", 429: "rate_limit_exceeded", 503: "service_unavailable"}.get(status, "error")
  body = {"error": {"message": message, "type": kind, "param": param, "code": None}}
  return responses.JSONResponse(body, status_code=status, headers=headers)


class Metrics:
  """The server's Prometheus metrics, in a registry of its own (several servers may share a process in tests)."""

  def __init__(self, slots: int):
    self.registry = prometheus_client.CollectorRegistry()
    r = self.registry
    self.requests = prometheus_client.Counter(
        "maxbridge_requests", "requests answered, by endpoint and status", ["endpoint", "status"], registry=r
    )
    self._gauges = {
        "queue_depth": prometheus_client.Gauge("maxbridge_queue_depth", "requests waiting for a slot", registry=r),
        "slots_busy": prometheus_client.Gauge("maxbridge_slots_busy", "decode slots holding a request", registry=r),
    }
    prometheus_client.Gauge("maxbridge_slots", "decode slots in all", registry=r).set(slots)
    self._counters = {
        "generated_tokens": prometheus_client.Counter(
            "maxbridge_generated_tokens", "tokens generated (rate() gives tokens/s)", registry=r
        ),
        "decode_steps": prometheus_client.Counter("maxbridge_decode_steps", "engine decode steps", registry=r),
    }
    self._histograms = {
        "ttft": prometheus_client.Histogram(
            "maxbridge_time_to_first_token_seconds", "from admission to the queue to the first token", registry=r
        ),
        "slot_occupancy": prometheus_client.Histogram(
            "maxbridge_slot_occupancy",
            "busy slots per decode step: above 1, requests share steps (continuous batching)",
            buckets=[b + 0.5 for b in range(slots)],
            registry=r,
        ),
    }

  def set(self, name, value):
    self._gauges[name].set(value)

  def inc(self, name, value):
    self._counters[name].inc(value)

  def observe(self, name, value):
    self._histograms[name].observe(value)


def build_app(
    engine: engine_lib.Engine, codec: Codec, *, model_name: str, max_queue: int = 64
) -> tuple[fastapi.FastAPI, sched.Scheduler]:
  """The FastAPI app and its scheduler (started with the app, stopped with it)."""
  metrics = Metrics(engine.max_concurrent_decodes)
  scheduler = sched.Scheduler(engine, codec.decode, eos_ids=codec.eos_ids, max_queue=max_queue, metrics=metrics)
  routes = _Routes(engine, codec, scheduler, metrics, model_name)

  @contextlib.asynccontextmanager
  async def lifespan(app):
    scheduler.start()
    yield
    scheduler.stop(app.state.shutdown_timeout)

  app = fastapi.FastAPI(title="maxbridge", lifespan=lifespan)
  app.state.shutdown_timeout = 30.0
  app.exception_handler(fastapi.exceptions.RequestValidationError)(routes.invalid)
  app.exception_handler(_Error)(routes.refused)
  app.post("/v1/completions")(routes.completions)
  app.post("/v1/chat/completions")(routes.chat)
  app.get("/v1/models")(routes.models)
  app.get("/health")(routes.health)
  app.get("/metrics")(routes.metrics_text)
  return app, scheduler


class _Routes:
  """The app's routes, a method each, over what they share: the engine, its scheduler and metrics, the codec.

  The routes carry no docstrings: FastAPI would publish them in /openapi.json.
  """

  def __init__(
      self, engine: engine_lib.Engine, codec: Codec, scheduler: sched.Scheduler, metrics: Metrics, model_name: str
  ):
    self.engine, self.codec, self.scheduler, self.metrics, self.model_name = engine, codec, scheduler, metrics, model_name
    self.config = engine.config
    self.limit = engine.position_limit or self.config.max_target_length
    self.template = _chat_template(codec.chat_template)

  async def invalid(self, request, exc):
    first = exc.errors()[0]
    loc = [str(part) for part in first["loc"] if part != "body"]
    field = ".".join(loc) or "body"
    self.metrics.requests.labels(request.url.path, "400").inc()
    return _error(400, f"{field}: {first['msg']}", field)

  async def refused(self, request, exc: _Error):
    self.metrics.requests.labels(request.url.path, str(exc.status)).inc()
    return _error(exc.status, exc.message, exc.param, exc.headers)

  async def completions(self, body: CompletionBody, request: fastapi.Request):
    codec, config = self.codec, self.config
    prompt = codec.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
    if any(not 0 <= t < config.vocab_size for t in prompt):
      raise _Error(400, f"prompt: token ids must be in [0, vocab_size={config.vocab_size})", "prompt")
    params = self._sampling(body, prompt, body.max_tokens, 16, body.logprobs)
    events = await self._run(request, prompt, params, "/v1/completions")
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

      async def chunks():
        async for event in events:
          if isinstance(event, sched.TokenEvent):
            choice = {"index": event.index, "text": event.text, "logprobs": logprobs(event), "finish_reason": None}
          else:
            choice = {"index": event.index, "text": event.text, "logprobs": None, "finish_reason": event.reason}
          yield {**head, "choices": [choice]}

      return _sse(chunks())
    out = await _whole(request, events)
    choices = [{"index": i, "text": "", "logprobs": None, "finish_reason": None} for i in range(params.n)]
    counts = [0] * params.n
    for event in out:
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
    usage = {"prompt_tokens": len(prompt), "completion_tokens": sum(counts), "total_tokens": len(prompt) + sum(counts)}
    return {**head, "choices": choices, "usage": usage}

  async def chat(self, body: ChatBody, request: fastapi.Request):
    codec = self.codec
    if self.template is None:
      raise _Error(
          400,
          "this model has no chat template (tokenizer_config.json's chat_template in its tokenizer folder): "
          "use /v1/completions",
          "messages",
      )
    try:
      text = self.template.render(
          messages=[m.model_dump() for m in body.messages], add_generation_prompt=True, **codec.special_tokens
      )
    except jinja2.exceptions.TemplateError as e:
      raise _Error(400, f"the chat template refused these messages: {e}", "messages") from e
    prompt = codec.encode(text)
    k = (body.top_logprobs or 0) if body.logprobs else None
    params = self._sampling(body, prompt, body.max_completion_tokens or body.max_tokens, None, k)
    events = await self._run(request, prompt, params, "/v1/chat/completions")
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

  async def health(self):
    if self.scheduler.error is not None:
      return _error(503, f"the decode loop failed: {self.scheduler.error}")
    return {"status": "ok", "slots": self.engine.max_concurrent_decodes, "slots_busy": self.scheduler.busy_slots}

  async def metrics_text(self):
    return responses.Response(prometheus_client.generate_latest(self.metrics.registry), media_type="text/plain")

  def _sampling(self, body: _Body, prompt: list[int], max_tokens: int | None, default_tokens: int | None, logprobs):
    config, limit, slots = self.config, self.limit, self.engine.max_concurrent_decodes
    if len(prompt) == 0:
      raise _Error(400, "the prompt is empty: give at least one token", "prompt")
    if len(prompt) > config.max_prefill_predict_length:
      raise _Error(
          400,
          f"the prompt has {len(prompt)} tokens, more than max_prefill_predict_length="
          f"{config.max_prefill_predict_length}, the longest this server prefills",
          "prompt",
      )
    room = limit - len(prompt)
    max_tokens = max_tokens or default_tokens or room
    if max_tokens > room:
      raise _Error(
          400,
          f"the prompt ({len(prompt)} tokens) and max_tokens={max_tokens} pass max_target_length={limit}, the "
          f"tokens a slot's cache holds: ask for at most {room} new tokens",
          "max_tokens",
      )
    if body.n > slots:
      raise _Error(400, f"n={body.n}: this server has {slots} decode slots", "n")
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
    )

  async def _run(self, request: fastapi.Request, prompt: list[int], params: sched.SamplingParams, endpoint: str):
    """Queues the request; yields the scheduler's events until every choice finishes; cancels if abandoned."""
    scheduler = self.scheduler
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    job = sched.Request(prompt, params, lambda event: loop.call_soon_threadsafe(events.put_nowait, event))
    try:
      scheduler.submit(job)
    except sched.QueueFull as e:
      raise _Error(429, f"{e}; retry later", headers={"Retry-After": "1"}) from e
    except sched.Draining as e:
      raise _Error(503, str(e)) from e
    self.metrics.requests.labels(endpoint, "200").inc()

    async def stream():
      left = params.n
      try:
        while left:
          event = await events.get()
          if isinstance(event, sched.FinishEvent):
            if event.reason in ("cancelled", "error"):
              return
            left -= 1
          yield event
      finally:
        if left:
          scheduler.cancel(job)

    return stream()


def _chat_template(source: str | None):
  if not source:
    return None
  # As transformers renders chat templates: a sandbox, trimmed blocks, raise_exception for the template's checks.
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env.globals["raise_exception"] = raise_exception
  return env.from_string(source)


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
      raise _Error(499, "client disconnected")
  task.result()
  return out


def _sse(chunks):
  async def body():
    async for chunk in chunks:
      yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"

  return responses.StreamingResponse(body(), media_type="text/event-stream")


async def _collect(events, out: list) -> None:
  async for event in events:
    out.append(event)


class _Server(uvicorn.Server):
  """uvicorn's server, whose SIGTERM/SIGINT stop the scheduler admitting and end the process with status 0."""

  def __init__(self, config: uvicorn.Config, scheduler: sched.Scheduler):
    super().__init__(config)
    self.scheduler = scheduler

  def handle_exit(self, sig, frame) -> None:
    self.scheduler.drain()
    super().handle_exit(sig, frame)

  @contextlib.contextmanager
  def capture_signals(self):
    # uvicorn raises a captured signal again once it has shut down; a drained server has done what the signal
    # asked, so it exits 0 instead of dying of it.
    with super().capture_signals():
      yield
      self._captured_signals.clear()


def serve(
    engine: engine_lib.Engine,
    codec: Codec,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    model_name: str = "maxbridge",
    max_queue: int = 64,
    shutdown_timeout: float = 30.0,
) -> None:
  """Serves `engine` until SIGTERM or SIGINT; returns after a graceful shutdown."""
  app, scheduler = build_app(engine, codec, model_name=model_name, max_queue=max_queue)
  app.state.shutdown_timeout = shutdown_timeout
  config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=shutdown_timeout, log_level="warning")
  _Server(config, scheduler).run()
