"""Continuous batching over `mb.Engine`'s slots: one thread owns the engine, requests come and go between steps.

Between two decode steps the loop admits waiting requests into free slots
(prefilled together, `prefill_batch`, when several wait; a request of n
choices by one `prefill_multisampling` and `bulk_insert`), and frees at once
the slots of choices that finished (max_tokens, a stop string, end of
sequence) or whose request was cancelled (the client went away). Each slot
samples by its own request's settings (`SlotSampling`). Text is decoded here,
token by token, so that a stop string ends its slot on the step that makes it.

The loop talks to the server only through `Request.emit` (called on this
thread with one event per token and one per finished choice) and `cancel`.
If a step fails, the requests in flight end with an "error" event naming the
failure and the loop starts again on a fresh decode state; the requests still
queued wait for it. Failing `MAX_FAILURES` times in a row (no decode step
between) it gives up: `error` is set and `submit` refuses.
"""

import collections
import dataclasses
import functools
import logging
import threading
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.serving.engine import Engine
from maxbridge.serving.slot_sampling import MAX_LOGIT_BIAS, SlotSampling, sample_slots, score_tokens

log = logging.getLogger(__name__)

# Most alternatives a request may ask per token (OpenAI's top_logprobs maximum); one compiled shape serves all.
MAX_LOGPROBS = 20
# Failures in a row, with no decode step that worked between them, before the loop gives up instead of starting again.
MAX_FAILURES = 3


class QueueFull(Exception):
  """The bounded queue of waiting requests is full: the caller should retry later (HTTP 429)."""


class Draining(Exception):
  """The server is shutting down, or its decode loop gave up, and admits nothing new (HTTP 503)."""


@dataclasses.dataclass
class SamplingParams:
  max_tokens: int
  temperature: float = 1.0
  top_p: float = 1.0
  top_k: int = 0
  n: int = 1
  seed: int = 0
  stop: tuple[str, ...] = ()
  logprobs: int | None = None  # alternatives per token, or None for no log-probabilities
  presence_penalty: float = 0.0
  frequency_penalty: float = 0.0
  logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), at most MAX_LOGIT_BIAS


@dataclasses.dataclass
class TokenEvent:
  """One generated token of choice `index`: the text it adds (held back while it may start a stop string)."""

  index: int
  text: str
  token: int
  logprob: float | None = None
  top: list[tuple[int, float]] | None = None


@dataclasses.dataclass
class FinishEvent:
  index: int
  reason: str  # "stop" | "length" | "cancelled" | "error" (the loop failed) | "shutdown" (stopped before the end)
  text: str = ""  # text held back until now
  message: str = ""  # why, for "error" and "shutdown"


@dataclasses.dataclass
class _Choice:
  request: "Request"
  index: int
  slot: int
  ids: list[int] = dataclasses.field(default_factory=list)
  sent: int = 0  # characters of the decoded text already emitted


class Request:
  """A prompt with its sampling; `emit(event)` is called on the loop's thread for each `TokenEvent`/`FinishEvent`."""

  def __init__(self, prompt: list[int], params: SamplingParams, emit: Callable[[object], None], images=None):
    # images: float32 [N, H, W, C] for the prompt's image tokens (a model with a vision tower), or None.
    self.prompt, self.params, self.emit, self.images = prompt, params, emit, images
    self.cancelled = False
    self.aborted = ""  # why the server ended it before its end ("shutdown"), if it did
    self.submitted = time.monotonic()
    self.first_token: float | None = None


class Scheduler:
  """Runs `engine` on its own thread; `submit` queues a request, `cancel` drops it, `drain` lets the rest finish."""

  def __init__(
      self, engine: Engine, decode: Callable[[list[int]], str], *, eos_ids=(), max_queue: int = 64, metrics=None
  ):
    self.engine, self.decode, self.eos_ids = engine, decode, frozenset(eos_ids)
    self.max_queue, self.metrics = max_queue, metrics
    self.slots: list[_Choice | None] = [None] * engine.max_concurrent_decodes
    self._waiting: collections.deque[Request] = collections.deque()
    self._cond = threading.Condition()
    self._draining = self._stopped = False
    self._thread = threading.Thread(target=self._run, name="maxbridge-decode", daemon=True)
    self._sample_first = jax.jit(sample_slots)
    self._top_logprobs = jax.jit(functools.partial(score_tokens, top=MAX_LOGPROBS))
    slots = len(self.slots)
    self._sampling = SlotSampling(
        np.zeros(slots, np.float32),
        np.zeros(slots, np.int32),
        np.ones(slots, np.float32),
        np.zeros(slots, np.uint32),
        np.zeros(slots, np.float32),
        np.zeros(slots, np.float32),
        np.zeros((slots, MAX_LOGIT_BIAS), np.int32),
        np.zeros((slots, MAX_LOGIT_BIAS), np.float32),
    )
    self._device_sampling = None  # the arrays above on the device, remade only when a slot's request changes
    self._pending_release: list[int] = []  # slots of finished choices, freed in the engine before the next step
    self._admitting = 0  # slots of requests taken off the queue and not yet inserted
    self._admitted: list[Request] = []  # those requests
    self._steps_read = 0  # decode steps whose tokens came back: a failure after one is not "in a row"
    self.failures = 0  # the loop's failures in all (each started it again, but the last if it gave up)
    self.error: BaseException | None = None  # the last failure, once the loop gave up

  # --- the server's side ------------------------------------------------------------------------

  def start(self) -> None:
    self._thread.start()

  def submit(self, request: Request) -> None:
    with self._cond:
      if self.error is not None:
        raise Draining(f"the decode loop failed {MAX_FAILURES} times in a row and stopped: {_reason(self.error)}")
      if self._draining:
        raise Draining("the server is shutting down")
      # Requests the free slots will take on the loop's next turn are not queued yet, whatever that turn costs.
      unclaimed = len(self.slots) - self.busy_slots - self._admitting
      if len(self._waiting) - unclaimed >= self.max_queue:
        raise QueueFull(f"{len(self._waiting)} requests are waiting, the most this server queues (--max-queue)")
      self._waiting.append(request)
      self._gauge("queue_depth", len(self._waiting))
      self._cond.notify()

  def cancel(self, request: Request) -> None:
    with self._cond:
      request.cancelled = True
      self._cond.notify()

  def drain(self) -> None:
    """Admits nothing new; what is queued or decoding goes on."""
    with self._cond:
      self._draining = True
      self._cond.notify()

  def abort(self, message: str) -> None:
    """Ends every request queued or decoding with a "shutdown" event saying `message`."""
    with self._cond:
      for request in {*self._waiting, *self._admitted, *(c.request for c in self.slots if c)}:
        request.aborted, request.cancelled = message, True
      self._cond.notify()

  def stop(self, timeout: float) -> None:
    """Drains, waits up to `timeout` s for requests in flight, then aborts the rest and ends the loop."""
    self.drain()
    deadline = time.monotonic() + timeout
    with self._cond:
      while (self._waiting or any(self.slots)) and self._thread.is_alive() and time.monotonic() < deadline:
        self._cond.wait(0.05)
    self.abort("the server shut down before this request finished")
    with self._cond:
      self._stopped = True
      self._cond.notify()
    self._thread.join(timeout=max(1.0, deadline - time.monotonic()))

  @property
  def busy_slots(self) -> int:
    return sum(choice is not None for choice in self.slots)

  # --- the loop ---------------------------------------------------------------------------------

  def _run(self) -> None:
    in_a_row = 0
    while True:
      steps = self._steps_read
      try:
        return self._loop()
      except Exception as e:  # pylint: disable=broad-exception-caught
        in_a_row = 1 if self._steps_read > steps else in_a_row + 1
        self._fail_in_flight(e, give_up=in_a_row >= MAX_FAILURES)
        if in_a_row >= MAX_FAILURES:
          return
      except BaseException as e:
        self._fail_in_flight(e, give_up=True)
        raise

  def _fail_in_flight(self, error: BaseException, give_up: bool) -> None:
    """Ends the requests in flight (and, giving up, those queued) with an "error" event naming `error`; frees
    every slot for a loop that starts again on a fresh decode state."""
    log.error("the decode loop failed%s", "" if give_up else "; starting it again", exc_info=error)
    self.failures += 1
    event = FinishEvent(0, "error", message=_reason(error))
    with self._cond:
      failed = {*self._admitted, *(c.request for c in self.slots if c)} | (set(self._waiting) if give_up else set())
      for request in failed:
        request.emit(event)
      if give_up:
        self._waiting.clear()
        self.error, self._stopped = error, True
      self.slots = [None] * len(self.slots)
      self._admitted, self._admitting, self._pending_release = [], 0, []
      self._idle(range(len(self.slots)))
      self._device_sampling = None
      self._gauge("slots_busy", 0)
      self._cond.notify_all()

  def _loop(self) -> None:
    state = self.engine.init_decode_state()
    # A step's tokens are read after the next step is dispatched: the host's work on them (text, stop
    # strings, streaming) overlaps the device's next step instead of leaving it idle. A choice that
    # finished decodes one step more, whose token is dropped, before its slot is freed.
    pending = None
    while True:
      with self._cond:
        while not self._stopped and not self._waiting and not any(self.slots) and pending is None:
          self._cond.notify_all()  # `stop` waits for an empty engine
          self._cond.wait()
        if self._stopped and not any(self.slots) and pending is None:
          for request in self._waiting:
            request.emit(_ended(request, 0))
          self._waiting.clear()
          return
        admitted = self._admit()
      state = self._release(state, [c for c in self.slots if c and c.request.cancelled])
      state = self._release(self._insert(state, admitted), [])
      launched = None
      if any(self.slots):
        state, launched = self._launch(state)
      if pending is not None:
        self._collect(pending)
        state = self._release(state, [])
      pending = launched

  def _admit(self) -> list[Request]:
    """Waiting requests, in order, while their choices fit the free slots (called holding the lock)."""
    free = len(self.slots) - self.busy_slots
    admitted = []
    while self._waiting and (self._waiting[0].cancelled or self._waiting[0].params.n <= free):
      request = self._waiting.popleft()
      if request.cancelled:
        request.emit(_ended(request, 0))
        continue
      free -= request.params.n
      self._admitting += request.params.n
      admitted.append(request)
      self._admitted.append(request)
    self._gauge("queue_depth", len(self._waiting))
    return admitted

  def _insert(self, state, requests: list[Request]):
    if not requests:
      return state
    single = [r for r in requests if r.params.n == 1 and r.images is None]  # a batched prefill takes text only
    prefixes = {}
    # In batches of a power of two: `prefill_batch` compiles once per batch size, and a size first met while
    # serving stalls every stream for that compile (seconds on CPU); log2(slots) sizes bound those stalls.
    while len(single) > 1:
      size = 1 << (len(single).bit_length() - 1)
      batch, single = single[:size], single[size:]
      prefixes.update(zip(map(id, batch), self.engine.prefill_batch([r.prompt for r in batch])))
    for request in requests:
      if id(request) not in prefixes:
        n, images = request.params.n, request.images
        prefix = self.engine.prefill_multisampling(request.prompt, num_samples=n, images=images) if n > 1 else None
        prefixes[id(request)] = prefix or self.engine.prefill(request.prompt, images=images)
    free = iter(i for i, choice in enumerate(self.slots) if choice is None)
    for request in requests:
      prefix, params = prefixes[id(request)], request.params
      slots = [next(free) for _ in range(params.n)]
      rows = _rows(params)
      for slot in slots:
        for column, value in zip(self._sampling, rows):
          column[slot] = value
      # Each choice's first token by its request's own sampling (the engine's prefill samples by the config's).
      sampling = SlotSampling(
          *(
              np.asarray([value + i if name == "seed" else value for i in range(params.n)])
              for name, value in zip(SlotSampling._fields, rows)
          )
      )
      first = self._sample_first(
          jnp.broadcast_to(prefix.logits, (params.n, prefix.logits.shape[-1])),
          sampling,
          jnp.full((params.n,), len(request.prompt) - 1, jnp.int32),
      )
      self._seed_slots(slots, params)
      state = self.engine.bulk_insert(prefix._replace(token=first if params.n > 1 else first[0]), state, slots)
      choices = [_Choice(request, i, slot) for i, slot in enumerate(slots)]
      with self._cond:
        for choice in choices:
          self.slots[choice.slot] = choice
        self._admitting -= params.n
        self._admitted.remove(request)
      self._device_sampling = None
      scores = None
      if params.logprobs is not None:
        logits = jnp.broadcast_to(prefix.logits, (params.n, prefix.logits.shape[-1]))
        scores = tuple(map(np.asarray, self._top_logprobs(logits, first)))
      self._deliver(choices, np.asarray(first), scores, range(params.n))
    self._gauge("slots_busy", self.busy_slots)
    return state

  def _seed_slots(self, slots, params: SamplingParams) -> None:
    # Choice i draws with seed + i: n choices of one prompt differ, and a seeded request repeats.
    for i, slot in enumerate(slots):
      self._sampling.seed[slot] = np.uint32((params.seed + i) % 2**32)

  def _launch(self, state):
    """Dispatches one decode step; (the new state, what `_collect` reads of it once the next is dispatched)."""
    if self._device_sampling is None:
      self._device_sampling = SlotSampling(*(jnp.asarray(column) for column in self._sampling))
    state, tokens = self.engine.generate(state, sampling=self._device_sampling)
    owners = [c for c in self.slots if c is not None]
    scores = None
    if any(c.request.params.logprobs is not None for c in owners):  # now: the next step donates state.logits
      scores = self._top_logprobs(state.logits, tokens)
    tokens.copy_to_host_async()
    self._count("decode_steps", 1)
    self._observe("slot_occupancy", len(owners))
    return state, (tokens, scores, owners)

  def _collect(self, launched) -> None:
    tokens, scores, owners = launched
    self._steps_read += 1
    live = [c for c in owners if self.slots[c.slot] is c and not c.request.cancelled]
    slots = [c.slot for c in live]
    self._deliver(live, np.asarray(tokens), None if scores is None else tuple(map(np.asarray, scores)), slots)

  def _deliver(self, choices: list[_Choice], tokens: np.ndarray, scores, rows) -> None:
    """Each choice's new token (row `rows[i]` of `tokens` and of `scores`, `score_tokens`' arrays): emitted as
    text, and its slot freed when that token ends the choice."""
    self._count("generated_tokens", len(choices))
    now = time.monotonic()
    finished = []
    for choice, row in zip(choices, rows):
      request, params, token = choice.request, choice.request.params, int(tokens[row])
      if request.cancelled:
        continue
      if request.first_token is None:
        request.first_token = now
        self._observe("ttft", now - request.submitted)
      logprob = top = None
      if params.logprobs is not None:
        chosen, top_values, top_ids = scores
        k = params.logprobs
        logprob, top = float(chosen[row]), list(zip(top_ids[row, :k].tolist(), top_values[row, :k].tolist()))
      if token in self.eos_ids:  # ends the choice; its own text is not part of the completion
        finished.append((choice, "stop"))
        continue
      choice.ids.append(token)
      text, reason = self._text(choice)
      if reason is None and len(choice.ids) >= params.max_tokens:
        reason = "length"
      request.emit(TokenEvent(choice.index, text, token, logprob, top))  # one per token, its text maybe held back
      if reason is not None:
        finished.append((choice, reason))
    for choice, reason in finished:
      self._finish(choice, reason)

  def _text(self, choice: _Choice) -> tuple[str, str | None]:
    """(the text choice's newest token adds, "stop" if a stop string now ends it else None)."""
    text = self.decode(choice.ids)
    stops = choice.request.params.stop
    found = [i for i in (text.find(s, max(0, choice.sent - len(s))) for s in stops) if i >= 0]
    if found:
      end = min(found)
      out, choice.sent = text[choice.sent : end], end
      return out, "stop"
    # Hold back an unfinished UTF-8 sequence, and a tail that may yet become a stop string.
    safe = len(text.rstrip("\ufffd"))
    for s in stops:
      for k in range(min(len(s) - 1, safe - choice.sent), 0, -1):
        if text[:safe].endswith(s[:k]):
          safe -= k
          break
    out = text[choice.sent : max(safe, choice.sent)]
    choice.sent = max(safe, choice.sent)
    return out, None

  def _finish(self, choice: _Choice, reason: str) -> None:
    """Frees the choice's slot; text held back (an unfinished character, a stop string's start) goes out now,
    unless a stop string cut it."""
    text = self.decode(choice.ids)
    rest = text[choice.sent :] if choice.sent < len(text) and not self._stopped_by_string(choice, text) else ""
    choice.request.emit(FinishEvent(choice.index, reason, rest))
    self._pending_release.append(choice.slot)
    self.slots[choice.slot] = None

  def _stopped_by_string(self, choice: _Choice, text: str) -> bool:
    return any(s in text for s in choice.request.params.stop)

  def _release(self, state, cancelled: list[_Choice]):
    for choice in cancelled:
      choice.request.emit(_ended(choice.request, choice.index))
      self._pending_release.append(choice.slot)
      self.slots[choice.slot] = None
    if self._pending_release:
      self._idle(self._pending_release)
      self._device_sampling = None
      state = self.engine.release(state, self._pending_release)
      self._pending_release = []
      self._gauge("slots_busy", self.busy_slots)
      with self._cond:
        self._cond.notify_all()
    return state

  def _idle(self, slots) -> None:
    # Idle slots decode greedily, unpenalized: a step with no request asking for either skips the sort and the
    # penalties (`lax.cond`).
    for slot in slots:
      for column in (self._sampling.temperature, self._sampling.presence, self._sampling.frequency):
        column[slot] = 0
      self._sampling.bias_values[slot] = 0

  # --- metrics ----------------------------------------------------------------------------------

  def _gauge(self, name, value):
    if self.metrics is not None:
      self.metrics.set(name, value)

  def _count(self, name, value):
    if self.metrics is not None:
      self.metrics.inc(name, value)

  def _observe(self, name, value):
    if self.metrics is not None:
      self.metrics.observe(name, value)


def _reason(error: BaseException) -> str:
  return f"the decode loop failed: {type(error).__name__}: {error}"


def _ended(request: Request, index: int) -> FinishEvent:
  """The event that ends a choice of a request cancelled by its client, or aborted by the server."""
  return FinishEvent(index, "shutdown", message=request.aborted) if request.aborted else FinishEvent(index, "cancelled")


def _rows(params: SamplingParams) -> tuple:
  """One slot's row of each `SlotSampling` column."""
  bias_ids = np.zeros(MAX_LOGIT_BIAS, np.int32)
  bias_values = np.zeros(MAX_LOGIT_BIAS, np.float32)
  for i, (token, value) in enumerate(params.logit_bias):
    bias_ids[i], bias_values[i] = token, value
  return (
      np.float32(params.temperature),
      np.int32(params.top_k),
      np.float32(params.top_p),
      np.uint32(params.seed),
      np.float32(params.presence_penalty),
      np.float32(params.frequency_penalty),
      bias_ids,
      bias_values,
  )
