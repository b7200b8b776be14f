"""The OpenAI API's side of `maxbridge serve`: request bodies with every field bounded, errors in OpenAI's shape,
and the limit on a request's size."""

from typing import Annotated, Literal

import pydantic
from fastapi import responses

from maxbridge.serving import scheduler as sched
from maxbridge.serving.slot_sampling import MAX_LOGIT_BIAS

MAX_REQUEST_BYTES = 8 * 2**20  # a long context's text several times over; larger bodies answer 413


class Strict(pydantic.BaseModel):
  """Every body: strict, so a wrong type is refused rather than coerced. Unknown fields are ignored."""

  # Python's JSON reads the non-standard NaN and Infinity, and 1e999 as infinity: no float field takes them.
  model_config = pydantic.ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)
  model: str | None = None


class Body(Strict):
  """Fields both completion endpoints share."""

  max_tokens: int | None = pydantic.Field(default=None, ge=1)
  temperature: float = pydantic.Field(default=1.0, ge=0, le=2)  # OpenAI's range
  top_p: float = pydantic.Field(default=1.0, gt=0, le=1)
  top_k: int = pydantic.Field(default=0, ge=-1)  # an extension, as vLLM's; 0 or -1: every token; <= vocab_size
  n: int = pydantic.Field(default=1, ge=1)
  stop: str | list[str] | None = None
  seed: int | None = None
  stream: bool = False
  # OpenAI's ranges. logit_bias: token id (a string, as JSON keys are) -> a bias added to its logit; the ids are
  # checked against the vocabulary by the server, which knows it.
  logit_bias: dict[str, Annotated[float, pydantic.Field(ge=-100, le=100)]] | None = pydantic.Field(
      default=None, max_length=MAX_LOGIT_BIAS
  )
  presence_penalty: float = pydantic.Field(default=0.0, ge=-2, le=2)
  frequency_penalty: float = pydantic.Field(default=0.0, ge=-2, le=2)

  def unsupported(self) -> str | None:
    """The first field set to something this server does not do, or None."""
    return None


class CompletionBody(Body):
  # One prompt (text or token ids) or several, as OpenAI's; each gets n choices, in order.
  prompt: str | list[str] | list[int] | list[list[int]]
  max_tokens: int | None = pydantic.Field(default=None, ge=0)  # 0 with echo: score the prompt, generate nothing
  logprobs: int | None = pydantic.Field(default=None, ge=0, le=sched.MAX_LOGPROBS)
  echo: bool = False
  best_of: int | None = pydantic.Field(default=None, ge=1)

  def unsupported(self) -> str | None:
    return super().unsupported() or ("best_of" if self.best_of not in (None, 1) else None)


class TextPart(Strict):
  type: Literal["text"]
  text: str


class ImageURL(Strict):
  url: str
  # OpenAI's resolution hint. A tower sees every image at its one size (image_size_for_vit): "low" or "high" would
  # ask for what it cannot give, so only "auto" is taken.
  detail: Literal["auto"] | None = None


class ImagePart(Strict):
  type: Literal["image_url"]
  image_url: ImageURL


# OpenAI's content parts; another type ("input_audio", "file") is refused naming it and the types taken.
Part = Annotated[TextPart | ImagePart, pydantic.Field(discriminator="type")]


class Message(pydantic.BaseModel):
  model_config = pydantic.ConfigDict(strict=True, extra="allow")
  role: str
  content: str | list[Part]


class ChatBody(Body):
  messages: list[Message] = pydantic.Field(min_length=1)
  max_completion_tokens: int | None = pydantic.Field(default=None, ge=1)
  logprobs: bool = False
  top_logprobs: int | None = pydantic.Field(default=None, ge=0, le=sched.MAX_LOGPROBS)


class TokenizeBody(Strict):
  """vLLM's /tokenize: a completion's `prompt`, or a chat's `messages` rendered as /v1/chat/completions renders them."""

  prompt: str | None = None
  messages: list[Message] | None = pydantic.Field(default=None, min_length=1)
  add_special_tokens: bool = True
  add_generation_prompt: bool = True
  return_token_strs: bool = False


class DetokenizeBody(Strict):
  tokens: list[int]


_TYPE_LABELS = frozenset({"str", "int", "float", "bool"})  # pydantic's labels of a union's plain branches


def invalid_field(errors: list[dict]) -> tuple[str, str]:
  """(the field a body's validation errors name, what is wrong with it).

  A union reports once per branch: the branches that got furthest into the value (the longest location) say what
  is wrong. The field's path leaves out pydantic's branch labels ("str", "list[...]") and a content part's tag,
  which OpenAI's parts repeat as the field after it ({"type": "image_url", "image_url": ...}).
  """
  deepest = max(len(error["loc"]) for error in errors)
  chosen = [error for error in errors if len(error["loc"]) == deepest]
  loc = chosen[0]["loc"]
  path = []
  for i, part in enumerate(loc):
    if part == "body" or (isinstance(part, str) and ("[" in part or part in _TYPE_LABELS)):
      continue
    if 0 < i < len(loc) - 1 and isinstance(loc[i - 1], int) and loc[i + 1] == part:
      continue  # a tagged part's tag
    path.append(str(part))
  return ".".join(path) or "body", "; ".join(dict.fromkeys(error["msg"] for error in chosen))


class Refusal(Exception):
  """A request answered `status` with `message` in OpenAI's error shape, naming the field `param` if one."""

  def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.headers = status, message, param, headers


_KINDS = {404: "not_found_error", 429: "rate_limit_exceeded", 500: "server_error", 503: "service_unavailable"}


def error_body(status: int, message: str, param: str | None = None) -> dict:
  kind = _KINDS.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")
  return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None):
  return responses.JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


class BodyLimit:
  """ASGI middleware: a request body over `limit` bytes answers 413 before the app parses any of it.

  The body is read to its end (and dropped past the limit) before answering: a client still sending when
  the connection closes would see a reset instead of the 413.
  """

  def __init__(self, app, limit: int):
    self.app, self.limit = app, limit

  async def __call__(self, scope, receive, send):
    if scope["type"] != "http":
      return await self.app(scope, receive, send)
    chunks, size, more = [], 0, True
    while more:
      message = await receive()
      if message["type"] != "http.request":
        return  # the client went away before its body was in
      size += len(message.get("body", b""))
      if size <= self.limit:
        chunks.append(message.get("body", b""))
      more = message.get("more_body", False)
    if size > self.limit:
      response = error_response(413, f"the request body has {size} bytes, more than this server's limit of {self.limit}")
      return await response(scope, receive, send)
    replayed = False

    async def replay():
      nonlocal replayed
      if replayed:
        return await receive()  # what comes after the body: the client's disconnect
      replayed = True
      return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    return await self.app(scope, replay, send)
