"""The decoder stack: learned positions (when the family has them), layers, final norm, output head.

The family entry (`config.family`) names each stack and its layer kind, and
`LAYER_CLASSES` maps a kind to this backend's layer class (`layer_classes`);
the stacks' sizes come from `canonical.layer_stacks`.
A layer returns (x, per-layer values); each value is stacked over the layers
and sown as `decoder/<key>`.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from maxbridge.core import bridge
from maxbridge.core import canonical
from maxbridge.core import pipeline_plan
from maxbridge.core.config import Config
from maxbridge.ops import linear
from maxbridge.ops import output_head
from maxbridge.ops import remat
from nnx_models import Module
from nnx_models.deepseek import DeepSeekDenseLayer, DeepSeekMoELayer
from nnx_models.embeddings import Embed
from nnx_models.gemma import Gemma2Block, Gemma3Block, Gemma3LocalLayer, GemmaDecoderLayer
from nnx_models.gemma4 import Gemma4Block, Gemma4Carry, Gemma4KVSharedBlock
from nnx_models.glm4_moe import Glm4MoeDecoderLayer
from nnx_models.gpt3 import Gpt3DecoderLayer
from nnx_models.gpt_oss import GptOssBlock
from nnx_models.linears import dense
from nnx_models.llama import DecoderLayer
from nnx_models.llama4 import Llama4Block
from nnx_models.mixtral import MixtralDecoderLayer
from nnx_models.mtp import MTPBlock
from nnx_models.normalizations import norm
from nnx_models import pipeline
from nnx_models.olmo2 import Olmo2DecoderLayer, Olmo3Block
from nnx_models.qwen3_moe import Qwen3MoeDecoderLayer
from nnx_models.qwen3_next import Qwen3NextBlock

LAYER_CLASSES = {
    "llama": DecoderLayer,
    "gpt3": Gpt3DecoderLayer,
    "mixtral": MixtralDecoderLayer,
    "deepseek_dense": DeepSeekDenseLayer,
    "deepseek_moe": DeepSeekMoELayer,
    "glm4_moe": Glm4MoeDecoderLayer,
    "gemma": GemmaDecoderLayer,
    "gemma2": Gemma2Block,
    "gemma3": Gemma3Block,
    "gemma3_local": Gemma3LocalLayer,
    "gpt_oss": GptOssBlock,
    "olmo2": Olmo2DecoderLayer,
    "olmo3": Olmo3Block,
    "qwen3_moe": Qwen3MoeDecoderLayer,
    "qwen3_next": Qwen3NextBlock,
    "llama4": Llama4Block,
    "gemma4": Gemma4Block,
    "gemma4_kv_shared": Gemma4KVSharedBlock,
}
# Family.layer_carry -> the module that builds what the layers pass on besides the hidden states.
LAYER_CARRIES = {"gemma4": Gemma4Carry}


def layer_classes(config: Config) -> dict[str, type[nnx.Module]]:
  """Stack name -> layer class, by the kind of layer the family's stack holds."""
  return {stack.name: LAYER_CLASSES[stack.kind] for stack in config.family.stacks}


class Decoder(Module):

  def __init__(self, config: Config, dot_general: linear.DotGeneral = jax.lax.dot_general, *, rngs: nnx.Rngs):
    cfg = self.config = config
    self.dot_general = dot_general  # the tied head's matmul
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype), rngs=rngs)
    if cfg.trainable_position_size:
      self.position_embedder = Embed(cfg.trainable_position_size, cfg.emb_dim, **dtypes)
    classes = layer_classes(cfg)
    if cfg.family.layer_carry:
      self.per_layer_inputs = LAYER_CARRIES[cfg.family.layer_carry](cfg, rngs=rngs)
    for name, count in canonical.layer_stacks(cfg):
      if cfg.scan_layers:
        setattr(self, name, _stacked_layers(classes[name], cfg, count, rngs, canonical.layer_axis(cfg, name)))
      else:
        for i in range(count):
          setattr(self, f"{name}_{i}", classes[name](cfg, rngs=rngs))
    self.decoder_norm = norm(cfg, rngs=rngs)
    if not cfg.logits_via_embedding:
      self.logits_dense = dense(cfg, (cfg.emb_dim,), (cfg.vocab_size,), ("embed", "vocab"), rngs=rngs)
    if cfg.mtp_num_layers:
      self.mtp = MTPBlock(cfg, classes[cfg.family.mtp_stack(cfg).name], rngs=rngs)

  def __call__(
      self,
      x: jax.Array,
      positions: jax.Array,
      segment_ids: jax.Array,
      embedding: jax.Array | None = None,
      tokens: jax.Array | None = None,
  ) -> jax.Array:
    """Embedded tokens [B, T, D] -> float32 logits [B, T, V]; `embedding` ties the head; `tokens` [B, T] (the ones
    embedded) for a family whose layers read them (Gemma 4's per-layer inputs)."""
    cfg = self.config
    embedded = x  # multi-token prediction embeds later tokens like this, without positions
    if cfg.trainable_position_size:
      x = x + self.position_embedder(positions)
    plan = pipeline_plan.pipeline_plan(cfg)
    if cfg.family.layer_carry:
      x = self.per_layer_inputs(x, tokens)
    per_stack = []
    for name, count in canonical.layer_stacks(cfg):
      pipelined = plan is not None and name == plan.stack
      # Decoding (a cache) runs the stack unpipelined; so does a Linen init (this
      # decoder behind ToLinen), which only declares the parameters.
      if pipelined and not _has_cache(getattr(self, name)) and not bridge.linen_initializing():
        x, outputs = pipeline.run(getattr(self, name), cfg, plan, x, positions, segment_ids)
      elif cfg.scan_layers:
        x, outputs = _scan_layers(getattr(self, name), cfg, x, positions, segment_ids)
      else:
        layer_outputs = []
        for i in range(count):
          x, out = _call_layer(getattr(self, f"{name}_{i}"), cfg, x, positions, segment_ids)
          layer_outputs.append(out)
        outputs = canonical.stack_layer_values(layer_outputs)
      per_stack.append(outputs)
    if cfg.family.layer_carry:
      x = x["x"]
    per_layer = canonical.concat_layer_stacks(per_stack)
    for key, value in per_layer.items():
      self.sow(nnx.Intermediate, key, value)
    if "moe_lb_losses" in per_layer:  # what the training loss adds: the mean over MoE layers
      self.sow(nnx.Intermediate, "moe_lb_loss", jnp.mean(per_layer["moe_lb_losses"]))
    # Before the final norm, which belongs to the output head: vocabulary
    # tiling runs that head itself, tile by tile.
    self.sow(nnx.Intermediate, "hidden_states", x)

    def head(h, norm=self.decoder_norm):
      return output_head.output_logits(
          h,
          norm=norm,
          project=None if cfg.logits_via_embedding else self.logits_dense,
          embedding=embedding,
          dtype=jnp.dtype(cfg.dtype),
          dot_general=self.dot_general,
          normalize_embedding_logits=cfg.normalize_embedding_logits,
          final_logits_soft_cap=cfg.final_logits_soft_cap,
      )

    logits = head(x)
    # Training only: decoding (a cache) predicts the next token alone.
    if cfg.mtp_num_layers and not _has_cache(self):
      hidden = self.mtp(x, embedded, positions, segment_ids)
      # Each module's hidden states come normed by its own head_norm (DeepSeek-V3's shared_head.norm).
      self.sow(nnx.Intermediate, "mtp_logits", jnp.stack([head(h, norm=lambda h: h) for h in hidden]))  # [K, B, T, V]
    return logits


def _stacked_layers(layer_class, config: Config, count: int, rngs: nnx.Rngs, layer_axis: str) -> nnx.Module:
  """`count` layers, one per split key: parameters stacked on param_scan_axis, other state on axis 0.

  The logical axis `layer_axis` ("layers", or the pipeline's `canonical.layer_axis`)
  is inserted there, as Linen's nn.scan does.
  """

  @nnx.split_rngs(splits=count)
  @nnx.vmap(
      in_axes=0,
      out_axes=nnx.StateAxes({nnx.Param: config.param_scan_axis, ...: 0}),
      transform_metadata={nnx.PARTITION_NAME: layer_axis},
  )
  def make_layers(rngs: nnx.Rngs) -> nnx.Module:
    return layer_class(config, rngs=rngs)

  return make_layers(rngs)


def _layer_step(graphdef: nnx.GraphDef, config: Config, positions: jax.Array, segment_ids: jax.Array):
  """(params, other state, x) -> (x, per-layer values, other state after the call), as a pure function.

  So jax.checkpoint and lax.scan see plain arrays, and what a layer writes
  (a cache, a sown value) comes back out to be stored, scanned or not.
  """

  def step(params: nnx.State, state: nnx.State, x: jax.Array):
    # The layer lives only inside this trace, so merge's fresh copy is the one
    # we want: its state is read back out below, never aliased.
    layer = nnx.merge(graphdef, params, state)
    x, per_layer = layer(x, positions, segment_ids)
    return x, per_layer, nnx.state(layer, nnx.Not(nnx.Param))

  if config.remat_policy == "none":
    return step
  # prevent_cse only matters outside scan, where XLA could otherwise merge the
  # recomputation back into the forward pass (the same choice nn.remat gets).
  return jax.checkpoint(step, policy=remat.checkpoint_policy(config.remat_policy), prevent_cse=not config.scan_layers)


def _has_cache(stack: nnx.Module) -> bool:
  """Whether the stack (or decoder) holds a decode cache: decoding runs it unpipelined, and without MTP."""
  return bool(jax.tree.leaves(nnx.state(stack, nnx.Cache)))


def _call_layer(layer: nnx.Module, config: Config, x: jax.Array, positions: jax.Array, segment_ids: jax.Array):
  graphdef, params, state = nnx.split(layer, nnx.Param, ...)
  x, per_layer, state = _layer_step(graphdef, config, positions, segment_ids)(params, state, x)
  nnx.update(layer, state)
  return x, per_layer


def _scan_layers(stack: nnx.Module, config: Config, x: jax.Array, positions: jax.Array, segment_ids: jax.Array):
  graphdef, params, state = nnx.split(stack, nnx.Param, ...)
  step = _layer_step(graphdef, config, positions, segment_ids)
  # lax.scan walks the leading axis; parameters are stacked on param_scan_axis.
  params = jax.tree.map(lambda a: jnp.moveaxis(a, config.param_scan_axis, 0), params)

  def body(x, layer):
    x, per_layer, state = step(*layer, x)
    return x, (per_layer, state)

  x, (per_layer, state) = jax.lax.scan(body, x, (params, state))
  nnx.update(stack, state)
  return x, per_layer
