"""Self-speculative decoding with the model's own multi-token prediction modules (DeepSeek-V3's MTP).

    tokens, stats = speculative.generate(config, model, prompts, max_new_tokens, num_draft=2)

Each step drafts `num_draft` tokens with MTP modules 1..num_draft, chained as
DeepSeek-V3 describes (module k reads module k-1's hidden state and the
embedding of the token k places ahead, and predicts the token after that),
then verifies them in ONE cached forward of the main model over the current
token and the drafts. The longest prefix of drafts that equals the main
model's greedy choice is kept, plus the main model's own next token, so each
step emits 1 to num_draft + 1 tokens and the output is greedy decoding's,
token for token, whatever the drafts are. The cache index is set back past
the rejected positions: their entries are overwritten by the next step's
forward and, until then, hidden from every query by their later positions.

Each MTP module keeps a KV cache of its own, since its decoder layer attends
over every earlier position of that module. Module k's row i needs token
i + k, which for the last k - 1 rows is a draft until verified: so each step
re-runs every module over the last 2 * num_draft rows (a fixed shape, one
compile), rewriting those rows with the tokens now known, then drafts at the
last. A step moves on by at most num_draft + 1 rows, so every row is rewritten
once all its tokens are known. Module k's row i sits at cache entry
i + 2 * num_draft (the entries before take rows before the prompt, written
with segment 0 and so never seen), at position i + k, as in training
(`ops.mtp.module_inputs`).

Greedy only (the acceptance test of sampling is another rule); no sliding
window ring, whose rewinding would lose entries the window still sees, and no
recurrent layer, whose one state per row cannot be rewound.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from maxbridge.core import canonical
from maxbridge.core.config import Config
from maxbridge.models import decoding, dispatch
from maxbridge.models import model as model_lib
from maxbridge.models.model import Model
from maxbridge.ops import embedding as embedding_ops
from maxbridge.ops import kv_cache

Params = dict[str, Any]


class State(NamedTuple):
  """Per row: caches, the current token (its position `next_pos`, not yet in the main cache) and the recent past."""

  cache: Params  # the main model's
  mtp_caches: tuple[Params, ...]  # module k's at [k - 1]
  token: jax.Array  # int32 [B]: t_n, the last token emitted
  next_pos: jax.Array  # int32 [B]: n
  hidden: jax.Array  # [B, R, D]: the main model's hidden states of rows n - R .. n - 1, R = `rewritten`
  window: jax.Array  # int32 [B, R]: tokens n - R + 1 .. n (zeros before the prompt)


class Stats(NamedTuple):
  """What a `generate` call drafted and kept: the accepted-token rate and the tokens per verify forward."""

  steps: int  # verify forwards after the prefill
  drafted: int  # draft tokens proposed, over rows
  accepted: int  # of those, kept

  @property
  def acceptance_rate(self) -> float:
    return self.accepted / self.drafted if self.drafted else 0.0

  @property
  def tokens_per_step(self) -> float:
    """Tokens emitted per verify forward (plain greedy: 1)."""
    return (self.accepted + self.steps) / self.steps if self.steps else 0.0


def check(config: Config, num_draft: int) -> None:
  """Refuses a config or draft length that self-speculative decoding cannot run, naming the key."""
  if isinstance(num_draft, bool) or not isinstance(num_draft, int) or num_draft < 1:
    raise ValueError(f"speculative_mtp_tokens must be a whole number >= 1 to decode speculatively, got {num_draft!r}")
  if num_draft > config.mtp_num_layers:
    raise ValueError(
        f"speculative_mtp_tokens={num_draft} drafts one token per MTP module, and this model has "
        f"mtp_num_layers={config.mtp_num_layers}: ask for at most {config.mtp_num_layers}"
    )
  if config.decode_sampling_strategy != "greedy" and config.decode_sampling_temperature != 0:
    raise ValueError(
        f"speculative_mtp_tokens={num_draft} decodes greedily: set decode_sampling_strategy=greedy "
        f"(it is {config.decode_sampling_strategy!r})"
    )
  if decoding.has_ring(config):
    raise ValueError(
        f"speculative_mtp_tokens with decoder_block={config.decoder_block!r} and sliding_window_size="
        f"{kv_cache.window(config)}: a ring cache (a sliding window's or a chunked layer's) cannot be set back "
        "past rejected drafts; decode without speculation"
    )
  recurrent = [stack.name for stack in config.family.stacks if getattr(stack, "recurrent", False)]
  if recurrent:
    raise ValueError(
        f"speculative_mtp_tokens with decoder_block={config.decoder_block!r}: its recurrent layers (stack "
        f"{recurrent[0]!r}) hold one state per row, which cannot be set back past rejected drafts"
    )
  if config.quantization or config.lora_rank:
    raise ValueError("speculative_mtp_tokens drafts with the float base model: unset quantization and lora_rank")


class Speculator:
  """The jitted prefill and step of self-speculative decoding for one model, `num_draft` tokens drafted a step."""

  def __init__(self, config: Config, model: Model, num_draft: int):
    check(config, num_draft)
    self.config = decoding.decode_config(config)
    self.model = model_lib.decode_model(model)
    self.num_draft = num_draft
    self._drafters = [dispatch.mtp_drafter(self.config, k) for k in range(1, num_draft + 1)]
    self.prefill = jax.jit(self._prefill, static_argnames=("length",))
    self.step = jax.jit(self._step, donate_argnums=(1,))
    self.loop = jax.jit(self._loop, static_argnames=("max_new_tokens",))

  def generate(self, prompts, max_new_tokens: int, *, params: Params | None = None) -> tuple[np.ndarray, Stats]:
    """int prompts [B, P] (or [P]) -> (their `max_new_tokens` greedy next tokens [B, N] (or [N]), `Stats`).

    `params` (unrolled, as `decoding.decode_config`'s model takes them) default to the model's own.
    """
    prompts = np.asarray(prompts, np.int32)
    single = prompts.ndim == 1
    prompts = prompts[None] if single else prompts
    if prompts.ndim != 2 or prompts.shape[1] == 0:
      raise ValueError(f"prompts must be int [batch, length] with length >= 1, got shape {prompts.shape}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
      raise ValueError(f"max_new_tokens must be a whole number >= 1, got {max_new_tokens!r}")
    params = self.model.params() if params is None else params
    length = prompts.shape[1]
    # A row stops at `limit`; a step writes up to num_draft + 1 entries from there, which the caches hold.
    limit = length + max_new_tokens
    state = self.prefill(params, prompts, length=limit + self.num_draft + 1)
    tokens, steps, drafted, accepted = (
        np.asarray(x) for x in self.loop(params, state, np.int32(limit), max_new_tokens=max_new_tokens)
    )
    tokens = tokens[:, :max_new_tokens]
    return (tokens[0] if single else tokens), Stats(int(steps), int(drafted), int(accepted))

  def _loop(self, params, state: State, limit, *, max_new_tokens: int):
    """Steps until every row holds `max_new_tokens`, in one compiled loop: (tokens [B, >= max_new_tokens], steps,
    drafts proposed, drafts kept), counting a row's steps only until it is done."""
    batch, width = state.token.shape[0], self.num_draft + 1
    # Room past the end: a done row's last write may start up to num_draft + 1 past max_new_tokens.
    out = jnp.zeros((batch, max_new_tokens + 2 * width), jnp.int32).at[:, 0].set(state.token)
    filled = jnp.ones((batch,), jnp.int32)

    def body(carry):
      state, out, filled, steps, drafted, accepted = carry
      live = filled < max_new_tokens
      state, emitted, count = self._step(params, state, limit)
      for b in range(batch):  # a row's emitted tokens at its own offset; beyond `count` they are written over next
        out = out.at[b].set(jax.lax.dynamic_update_slice(out[b], emitted[b], (filled[b],)))
      count = jnp.where(live, count, 0)
      drafted += self.num_draft * live.sum()
      accepted += jnp.where(live, count - 1, 0).sum()
      return state, out, filled + count, steps + 1, drafted, accepted

    zero = jnp.zeros((), jnp.int32)
    carry = (state, out, filled, zero, zero, zero)
    _, out, _, steps, drafted, accepted = jax.lax.while_loop(
        lambda carry: jnp.min(carry[2]) < max_new_tokens, body, carry
    )
    return out, steps, drafted, accepted

  # --- pieces ---------------------------------------------------------------------------------

  def _embed(self, params, tokens):
    return embedding_ops.embed(tokens, params["token_embedder"]["embedding"], dtype=jnp.dtype(self.config.dtype))

  def _draft(self, params, k, cache, hidden, tokens, positions, segment_ids):
    """Module k over rows given by their hidden states [B, R, D] and tokens i + k [B, R]: (logits, hidden, cache)."""
    decoder = params["decoder"]
    own = {f"mtp_layer_{k}": decoder["mtp"][f"mtp_layer_{k}"]}
    if "logits_dense" in decoder:
      own["logits_dense"] = decoder["logits_dense"]
    table = params["token_embedder"]["embedding"] if self.config.logits_via_embedding else None
    embedded = self._embed(params, tokens)
    return self._drafters[k - 1](own, cache, hidden, embedded, positions, segment_ids, table)

  def _mtp_cache(self, k: int, batch: int, length: int) -> Params:
    """Module k's empty cache: one decoder layer's entries, at the drafter's paths."""
    entries = decoding.init_cache(self.config, batch, length)
    one = canonical.flatten(entries)
    layer = next(iter(one)).rsplit("/", 1)[0]  # any layer: each has the same entries
    own = {path.rsplit("/", 1)[1]: leaf for path, leaf in one.items() if path.startswith(layer + "/")}
    return {f"mtp_layer_{k}": {"layer": {"self_attention": own}}}

  # --- prefill --------------------------------------------------------------------------------

  def _prefill(self, params, prompts, *, length: int) -> State:
    """int32 prompts [B, P] (all real) -> the state after the prompt, its first token emitted; caches of `length`."""
    batch, prompt_length = prompts.shape
    extra = rewritten(self.num_draft)
    cache = decoding.init_cache(self.config, batch, length)
    positions = jnp.broadcast_to(jnp.arange(prompt_length, dtype=jnp.int32), prompts.shape)
    ones = jnp.ones_like(prompts)
    logits, hidden, cache = self.model.cached_forward_hidden(params, cache, prompts, positions, ones)
    first = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
    # Module k's rows 0..P-1, with token i + k where the prompt and first token have it (zeros past: those rows
    # are rewritten by the first step, which knows their tokens).
    known = jnp.concatenate([prompts, first[:, None], jnp.zeros((batch, self.num_draft), jnp.int32)], axis=1)
    mtp_caches, h = [], hidden
    for k in range(1, self.num_draft + 1):
      mtp_cache = _set_index(self._mtp_cache(k, batch, length + extra), jnp.full((batch,), extra, jnp.int32))
      _, h, mtp_cache = self._draft(params, k, mtp_cache, h, known[:, k : k + prompt_length], positions + k, ones)
      mtp_caches.append(mtp_cache)
    pad_hidden = jnp.zeros((batch, extra, hidden.shape[-1]), hidden.dtype)
    pad_tokens = jnp.zeros((batch, extra), jnp.int32)
    return State(
        cache,
        tuple(mtp_caches),
        first,
        jnp.full((batch,), prompt_length, jnp.int32),
        jnp.concatenate([pad_hidden, hidden], axis=1)[:, -extra:],
        jnp.concatenate([pad_tokens, prompts, first[:, None]], axis=1)[:, -extra:],
    )

  # --- one step -------------------------------------------------------------------------------

  def propose(self, params, state: State) -> tuple[jax.Array, jax.Array, tuple[Params, ...]]:
    """The drafts of `state`'s next tokens: (int32 [B, num_draft] tokens n + 1 .., their float32 logits
    [B, num_draft, V], the MTP caches with the last rows rewritten)."""
    _, mtp_caches, _, n, hidden, window = state
    extra = rewritten(self.num_draft)
    rows = n[:, None] - extra + jnp.arange(extra, dtype=jnp.int32)  # [B, extra]
    segment_ids = (rows >= 0).astype(jnp.int32)
    tokens, h, new_caches, drafts, draft_logits = window, hidden, [], [], []
    for k in range(1, self.num_draft + 1):
      # Row i's entry sits at i + extra: the block of rows n - extra .. n - 1 starts at n.
      mtp_cache = _set_index(mtp_caches[k - 1], n)
      logits, h, mtp_cache = self._draft(params, k, mtp_cache, h, tokens[:, k - 1 : k - 1 + extra], rows + k, segment_ids)
      new_caches.append(mtp_cache)
      draft_logits.append(logits[:, -1])
      drafts.append(jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32))
      tokens = jnp.concatenate([tokens, drafts[-1][:, None]], axis=1)
    return jnp.stack(drafts, axis=1), jnp.stack(draft_logits, axis=1), tuple(new_caches)

  def _step(self, params, state: State, limit):
    """Draft, verify, accept: (new state, emitted int32 [B, num_draft + 1] (row b's first `count[b]` real), count)."""
    drafts, _, mtp_caches = self.propose(params, state)
    cache, _, token, n, hidden, window = state
    draft_count, extra = self.num_draft, rewritten(self.num_draft)
    block = jnp.concatenate([token[:, None], drafts], axis=1)  # positions n .. n + num_draft
    positions = n[:, None] + jnp.arange(draft_count + 1, dtype=jnp.int32)
    logits, verified, cache = self.model.cached_forward_hidden(params, cache, block, positions, jnp.ones_like(block))
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, num_draft + 1]: tokens n + 1 .. n + num_draft + 1
    accepted = jnp.cumprod((drafts == greedy[:, :draft_count]).astype(jnp.int32), axis=1).sum(axis=1)
    count = accepted + 1  # the accepted drafts equal greedy's choices, then greedy's own next token
    new_n = jnp.minimum(n + count, limit)  # a row done already stays within its cache
    last = jnp.take_along_axis(greedy, accepted[:, None], axis=1)[:, 0]

    # The recent past, moved on by `count` rows: old rows then the verified ones, from row `count` on.
    take = count[:, None] + jnp.arange(extra)
    hidden = jnp.take_along_axis(jnp.concatenate([hidden, verified], axis=1), take[:, :, None], axis=1)
    window = jnp.take_along_axis(jnp.concatenate([window, greedy], axis=1), take, axis=1)
    state = State(_set_index(cache, new_n), mtp_caches, last, new_n, hidden, window)
    return state, greedy, count


def rewritten(num_draft: int) -> int:
  """The MTP rows each step rewrites: enough that a step of num_draft + 1 never skips a row's last chance."""
  return max(2 * num_draft, 2)


def _set_index(cache: Params, index) -> Params:
  """Every layer's next write index set to `index` [B]: rejected drafts' entries get overwritten."""
  flat = canonical.flatten(cache)
  for path, leaf in flat.items():
    if path.endswith("/" + kv_cache.INDEX):
      flat[path] = jnp.broadcast_to(index, leaf.shape).astype(leaf.dtype)
  return canonical.unflatten(flat)


def generate(
    config: Config, model: Model, prompts, max_new_tokens: int, num_draft: int, *, params: Params | None = None
) -> tuple[np.ndarray, Stats]:
  """int prompts [B, P] (or [P]) -> (their `max_new_tokens` greedy next tokens [B, N] (or [N]), `Stats`).

  `Speculator(config, model, num_draft).generate(...)`; keep the speculator to reuse its compiled steps.
  """
  return Speculator(config, model, num_draft).generate(prompts, max_new_tokens, params=params)
