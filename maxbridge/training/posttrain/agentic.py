"""Multi-turn tool-use RL: environments, episodes through `mb.Engine`'s slots, and asynchronous GRPO on them.

An `Environment` is a task with tools: `reset(seed)` gives the task's first
message, `step(model_message)` answers each model turn with an `Observation`
(a tool's output to append to the transcript, or None; a reward; whether the
episode is done). Tool calls are parsed from the model's text; the built-in
`CalculatorEnv` uses one tag,

    <calc>EXPRESSION</calc>      ->  <out>VALUE</out>

(integers, + - * / and parentheses, evaluated by a parser, never `eval`), and
the model's next turn, one line, is its answer: reward 1.0 when it is the
task's value, else 0.0.

`run_episodes` plays many episodes at once through an engine's slots, a turn
at a time (continuous batching): a turn's transcript is prefilled into a free
slot and decoded until the text ends with one of the environment's `stops`
(a tag close, a newline), `max_turn_tokens`, or the end of the cache; then its
slot is released, the environment answers, and the next waiting turn (this
episode's next, or another's) takes the slot. Every sampled token's
log-probability is read from the logits the slot sampled it from (the
sampling policy's, `old_log_probs`). A token is drawn with the key
fold_in(key(episode seed), position of the token before it), so an episode
samples the same tokens whichever slot it lands in and whatever runs beside it.

`pack_episodes` puts one episode per row: the whole transcript as inputs,
only the model's own tokens as targets (`targets_segmentation`: prompt and
tool outputs carry no loss), the episode's group-normalised advantage
(`grpo.group_advantages` over the `num_generations` episodes of one task) on
every position, and the old log-probabilities aligned with the targets. GRPO's
loss (`grpo.GRPO`) trains on it through its batch keys.

`train_agentic` runs rollouts in a thread beside the learner: the batch of
step k is sampled by policy version max(0, k - off_policy_steps) (the policy
after that many updates) while the learner trains on step k - 1's, so the
staleness (learner version - rollout version) is never above off_policy_steps
(Tunix's name; 0 is synchronous: sample, then train). Each step records its
staleness and the rollout's and the learner's tokens/s.

Rollouts re-prefill the whole transcript at each turn (a prompt cache across
turns would save that); a run is in memory, with no checkpoint of its own.
"""

from __future__ import annotations

import abc
import dataclasses
import re
import time
from collections import deque
from fractions import Fraction
from typing import Callable, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.core import canonical
from maxbridge.core.config import Config
from maxbridge.ops.losses import token_log_probs
from maxbridge.serving.engine import Engine
from maxbridge.serving.slot_sampling import SlotSampling, sample_slots
from maxbridge.training.posttrain import grpo, sft

# --- environments ------------------------------------------------------------------------------


class Observation(NamedTuple):
  """An environment's answer to one model turn."""

  text: str | None  # appended to the transcript before the model's next turn (a tool's output); None: nothing
  reward: float
  done: bool


class Environment(abc.ABC):
  """A task the model solves over turns; see the module docstring. One instance plays one episode at a time."""

  # A model turn ends when its text ends with one of these (or at max_turn_tokens).
  stops: tuple[str, ...] = ("\n",)

  @abc.abstractmethod
  def reset(self, seed: int) -> str:
    """Starts the episode of task `seed`; returns the task's first message (the prompt)."""

  @abc.abstractmethod
  def step(self, model_message: str) -> Observation:
    """The model's turn (its text, stop string included) -> the observation after it."""


class ToolError(ValueError):
  """A tool call that cannot be evaluated; the environment answers it with an error observation."""


CALL = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_TOKEN = re.compile(r"\s*(?:(\d+)|(.))")
MAX_EXPRESSION = 64  # characters: the parser recurses per parenthesis


def parse_tool_call(message: str) -> str | None:
  """The expression of the first `<calc>...</calc>` in a model message, or None when it calls no tool."""
  found = CALL.search(message)
  return None if found is None else found.group(1)


def evaluate(expression: str) -> Fraction:
  """An arithmetic expression (integers, + - * /, unary minus, parentheses) by recursive descent; ToolError
  on anything else. Never `eval`: the text is the model's."""
  if len(expression) > MAX_EXPRESSION:
    raise ToolError(f"an expression of at most {MAX_EXPRESSION} characters, got {len(expression)}")
  tokens = []
  for number, symbol in _TOKEN.findall(expression.rstrip()):
    if symbol and symbol not in "+-*/()":
      raise ToolError(f"unexpected {symbol!r} in {expression!r}: integers, + - * / and parentheses only")
    tokens.append(int(number) if number else symbol)
  value, rest = _sum(tokens)
  if rest:
    raise ToolError(f"unexpected {rest[0]!r} in {expression!r}")
  return value


def _sum(tokens):
  value, tokens = _product(tokens)
  while tokens and tokens[0] in ("+", "-"):
    op, (right, tokens) = tokens[0], _product(tokens[1:])
    value = value + right if op == "+" else value - right
  return value, tokens


def _product(tokens):
  value, tokens = _unary(tokens)
  while tokens and tokens[0] in ("*", "/"):
    op, (right, tokens) = tokens[0], _unary(tokens[1:])
    if op == "/" and right == 0:
      raise ToolError("division by zero")
    value = value * right if op == "*" else value / right
  return value, tokens


def _unary(tokens):
  if not tokens:
    raise ToolError("the expression ends where a number was expected")
  head = tokens[0]
  if head == "-":
    value, tokens = _unary(tokens[1:])
    return -value, tokens
  if head == "(":
    value, tokens = _sum(tokens[1:])
    if not tokens or tokens[0] != ")":
      raise ToolError("a '(' is never closed")
    return value, tokens[1:]
  if isinstance(head, int):
    return Fraction(head), tokens[1:]
  raise ToolError(f"unexpected {head!r} where a number was expected")


def format_value(value: Fraction) -> str:
  return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


class CalculatorEnv(Environment):
  """Synthetic arithmetic `a<op>b?` (two-digit operands, + - *) with a calculator tool.

  The intended episode: `<calc>a*b</calc>`, then the tool's `<out>value</out>`, then the answer on a line of
  its own. A first turn without a tool call is taken as the answer; after `max_turns` model turns the episode
  ends (reward 0 unless that turn answered).
  """

  stops = ("</calc>", "\n")
  operations = ("+", "-", "*")

  def __init__(self, max_turns: int = 2, operands: tuple[int, int] = (10, 99)):
    if max_turns < 1:
      raise ValueError(f"max_turns must be >= 1, got {max_turns}")
    self.max_turns, self.operands = max_turns, operands
    self.answer, self.turns = "", 0

  def question(self, seed: int) -> tuple[str, str]:
    """Task `seed`: (its expression, its value)."""
    rng = np.random.default_rng(seed)
    a, b = (int(x) for x in rng.integers(self.operands[0], self.operands[1] + 1, size=2))
    expression = f"{a}{self.operations[int(rng.integers(len(self.operations)))]}{b}"
    return expression, format_value(evaluate(expression))

  def reset(self, seed: int) -> str:
    expression, self.answer = self.question(seed)
    self.turns = 0
    return f"{expression}?"

  def step(self, model_message: str) -> Observation:
    self.turns += 1
    call = parse_tool_call(model_message)
    if call is not None:
      if self.turns >= self.max_turns:
        return Observation(None, 0.0, True)
      try:
        out = format_value(evaluate(call))
      except ToolError:
        out = "error"
      return Observation(f"<out>{out}</out>", 0.0, False)
    return Observation(None, float(model_message.strip() == self.answer), True)

  def expert_turns(self, seed: int) -> list[str]:
    """The intended model turns of task `seed` (for SFT warm-up transcripts)."""
    expression, answer = self.question(seed)
    return [f"<calc>{expression}</calc>", f"{answer}\n"]


def byte_encode(text: str) -> list[int]:
  return list(text.encode("utf-8"))


def byte_decode(tokens: Sequence[int]) -> str:
  return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")


# --- episodes ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Episode:
  """One episode's transcript: every token, which the model generated, and each generated token's
  log-probability under the policy that sampled it (0.0 elsewhere)."""

  task: int
  seed: int  # the sampling key's seed
  env: Environment
  tokens: list[int] = dataclasses.field(default_factory=list)
  generated: list[bool] = dataclasses.field(default_factory=list)
  log_probs: list[float] = dataclasses.field(default_factory=list)
  reward: float = 0.0
  turns: int = 0
  done: bool = False
  truncated: bool = False  # ended by max_turns or the cache's length, not by the environment
  turn_start: int = 0

  def append(self, tokens: Sequence[int], generated: bool, log_probs: Sequence[float] | None = None) -> None:
    self.tokens += [int(t) for t in tokens]
    self.generated += [generated] * len(tokens)
    self.log_probs += [0.0] * len(tokens) if log_probs is None else [float(p) for p in log_probs]

  @property
  def model_tokens(self) -> int:
    return sum(self.generated)

  def turn_stopped(self, decode) -> bool:
    """Whether the current turn's text ends with one of the environment's stops."""
    return decode(self.tokens[self.turn_start :]).endswith(self.env.stops)


def transcript(env: Environment, seed: int, turns: Sequence[str], encode=byte_encode) -> Episode:
  """The episode `turns` (model messages, in order) play in `env` on task `seed`: a demonstration for SFT,
  or a hand-made episode for a test."""
  episode = Episode(seed, 0, env)
  episode.append(encode(env.reset(seed)), False)
  for message in turns:
    episode.append(encode(message), True)
    observation = env.step(message)
    episode.reward += observation.reward
    if observation.done:
      episode.done = True
      break
    if observation.text:
      episode.append(encode(observation.text), False)
  return episode


@jax.jit
def _first_tokens(logits, sampling, positions):
  return sample_slots(logits, sampling, positions)


_sampled_log_probs = jax.jit(token_log_probs)


def _sampling(temperature: float, seeds: np.ndarray) -> SlotSampling:
  count = len(seeds)
  return SlotSampling(
      jnp.full((count,), temperature, jnp.float32),
      jnp.zeros((count,), jnp.int32),
      jnp.ones((count,), jnp.float32),
      jnp.asarray(seeds, jnp.uint32),
  )


def run_episodes(
    engine: Engine,
    episodes: list[Episode],
    *,
    params=None,
    temperature: float = 1.0,
    max_turns: int = 2,
    max_turn_tokens: int = 32,
    encode: Callable[[str], list[int]] = byte_encode,
    decode: Callable[[Sequence[int]], str] = byte_decode,
) -> list[Episode]:
  """Plays `episodes` (each reset, its prompt in `tokens`) to the end through `engine`'s slots; see the module
  docstring. `params`: the policy's canonical parameters (default the engine's own). Returns `episodes`."""
  limit = engine.config.max_target_length
  prefill_limit = engine.config.max_prefill_predict_length
  slots = engine.max_concurrent_decodes
  state = engine.init_decode_state()
  seeds = np.zeros(slots, np.uint32)
  waiting = deque(i for i, e in enumerate(episodes) if not e.done)
  active: dict[int, int] = {}  # slot -> episode
  free = list(range(slots - 1, -1, -1))

  def end_turn(i: int) -> None:
    episode = episodes[i]
    observation = episode.env.step(decode(episode.tokens[episode.turn_start :]))
    episode.turns += 1
    episode.reward += observation.reward
    if observation.done:
      episode.done = True
      return
    extra = encode(observation.text or "")
    # The next turn's prefill holds the transcript and must leave the cache room for one token at least.
    if episode.turns >= max_turns or len(episode.tokens) + len(extra) > min(prefill_limit, limit - 1):
      episode.done = episode.truncated = True
      return
    episode.append(extra, False)
    waiting.append(i)

  while waiting or active:
    while waiting and free:
      i, slot = waiting.popleft(), free.pop()
      episode = episodes[i]
      prompt = np.asarray(episode.tokens, np.int32)
      prefix = engine.prefill(prompt, params=params)
      # The turn's first token, drawn as `generate` draws the rest: by the episode's seed and its position.
      sampling = _sampling(temperature, np.asarray([episode.seed], np.uint32))
      first = _first_tokens(prefix.logits[None], sampling, jnp.asarray([len(prompt) - 1], jnp.int32))[0]
      state = engine.insert(prefix._replace(token=first), state, slot)
      seeds[slot] = episode.seed
      active[slot] = i
      episode.turn_start = len(episode.tokens)
    tokens = np.asarray(state.tokens)
    log_probs = np.asarray(_sampled_log_probs(state.logits, state.tokens))
    finished = []
    for slot, i in active.items():
      episode = episodes[i]
      episode.append([tokens[slot]], True, [log_probs[slot]])
      turn_tokens = len(episode.tokens) - episode.turn_start
      if episode.turn_stopped(decode) or turn_tokens >= max_turn_tokens or len(episode.tokens) >= limit:
        finished.append(slot)
    if finished:
      state = engine.release(state, finished)
      for slot in finished:
        free.append(slot)
        i = active.pop(slot)
        if len(episodes[i].tokens) >= limit and not episodes[i].turn_stopped(decode):
          episodes[i].done = episodes[i].truncated = True  # the cache is full mid-turn
        else:
          end_turn(i)
    if active:
      state, _ = engine.generate(state, params=params, sampling=_sampling(temperature, seeds))
  return episodes


# --- packing -----------------------------------------------------------------------------------


def pack_episodes(episodes: list[Episode], advantages, length: int) -> dict[str, np.ndarray]:
  """One episode per row (see the module docstring): GRPO's batch keys plus `old_log_probs` [rows, length]."""
  examples = []
  for episode in episodes:
    if len(episode.tokens) > length:
      raise ValueError(f"an episode of {len(episode.tokens)} tokens does not fit a row of {length}")
    examples.append((np.asarray(episode.tokens, np.int32), np.asarray(episode.generated, bool)))
  rows = sft.fill_rows([[i] for i in range(len(episodes))], examples, length, True)
  count = len(episodes)
  rows["advantages"] = np.broadcast_to(np.asarray(advantages, np.float32).reshape(-1, 1), (count, length)).copy()
  old = np.zeros((count, length), np.float32)
  for r, episode in enumerate(episodes):
    old[r, : len(episode.tokens) - 1] = episode.log_probs[1:]  # targets[t] is token t + 1
  rows["old_log_probs"] = old
  return rows


# --- asynchronous GRPO on episodes ---------------------------------------------------------------


def rollout_engine(config: Config, params) -> Engine:
  """The rollout engine: `max_concurrency` slots, each transcript prefilled whole (up to max_target_length - 1)."""
  engine_config = config.replace(
      per_device_batch_size=config.max_concurrency,
      max_prefill_predict_length=config.max_target_length - 1,
      decode_sampling_strategy="greedy",  # the engine's own first token is replaced by the episode's draw
  )
  return Engine(engine_config, params)


def policy_loss(config: Config) -> grpo.GRPO:
  """GRPO's loss, reading `old_log_probs` where it can: a stale batch's sampling policy is not the learner's."""
  loss = grpo.GRPO.from_config(config)
  if "old_log_probs" not in loss.batch_keys and config.num_iterations == 1:
    # GRPO reads the sampling policy's log-probabilities whenever a batch is not the learner's own sample.
    loss = grpo.GRPO.from_config(config.replace(num_iterations=2))
  return loss


def episode_seed(seed: int, step: int, index: int) -> int:
  return int(np.random.SeedSequence([seed, step, index]).generate_state(1)[0])


class Rollouts:
  """Step k's episodes: `prompts_per_step` tasks (by seed and step), `num_generations` episodes each."""

  def __init__(self, config: Config, make_env: Callable[[], Environment], engine: Engine):
    self.config, self.make_env, self.engine = config, make_env, engine

  def episodes(self, step: int, params) -> list[Episode]:
    config, groups = self.config, self.config.num_generations
    tasks = np.random.default_rng([config.seed, step]).integers(0, 2**31, grpo.prompts_per_step(config))
    episodes = []
    for t, task in enumerate(tasks):
      for g in range(groups):
        env = self.make_env()
        episode = Episode(int(task), episode_seed(config.seed, step, t * groups + g), env)
        episode.append(byte_encode(env.reset(int(task))), False)
        episodes.append(episode)
    params = canonical.conform(params, self.engine.model.abstract_params(), self.engine.config.param_scan_axis)
    # Placed as the engine's own: the compiled steps are keyed by their inputs' shardings, and the learner's
    # state is sharded otherwise (a new placement would compile every step again).
    params = jax.tree.map(lambda new, own: jax.device_put(new, own.sharding), params, self.engine.params)
    return run_episodes(
        self.engine,
        episodes,
        params=params,
        temperature=self.config.decode_sampling_temperature,
        max_turns=self.config.max_turns,
        max_turn_tokens=self.config.max_turn_tokens,
    )

  def batch(self, step: int, params) -> tuple[dict[str, np.ndarray], dict]:
    began = time.perf_counter()
    episodes = self.episodes(step, params)
    seconds = time.perf_counter() - began
    rewards = np.asarray([e.reward for e in episodes], np.float64).reshape(-1, self.config.num_generations)
    advantages = grpo.group_advantages(rewards, self.config.scale_rewards, self.config.grpo_advantage_std)
    rows = pack_episodes(episodes, advantages, self.config.max_target_length)
    generated = sum(e.model_tokens for e in episodes)
    info = {
        "mean_reward": float(rewards.mean()),
        "model_tokens": float(generated / len(episodes)),
        "rollout_tokens_per_s": generated / seconds,
        "rollout_s": seconds,
        "transcripts": [byte_decode(e.tokens) for e in episodes],
    }
    return rows, info
