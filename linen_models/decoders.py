"""The decoder stack: learned positions (when the family has them), layers, final norm, output head.

The family entry (`config.family`) names each stack and its layer kind, and
`LAYER_CLASSES` maps a kind to this backend's layer class (`layer_classes`);
the stacks' sizes come from `canonical.layer_stacks`.
A layer returns (x, per-layer values); each value is stacked over the layers
and sown as `decoder/<key>`.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp

from linen_models.deepseek import DeepSeekDenseLayer, DeepSeekMoELayer
from linen_models.embeddings import Embed
from linen_models.gemma import Gemma2Block, Gemma3Block, Gemma3LocalLayer, GemmaDecoderLayer
from linen_models.gemma4 import Gemma4Block, Gemma4Carry, Gemma4KVSharedBlock
from linen_models.glm4_moe import Glm4MoeDecoderLayer
from linen_models.gpt3 import Gpt3DecoderLayer
from linen_models.gpt_oss import GptOssBlock
from linen_models.linears import dense
from linen_models.llama import DecoderLayer
from linen_models.llama4 import Llama4Block
from linen_models.mixtral import MixtralDecoderLayer
from linen_models.mtp import MTPBlock
from linen_models.normalizations import norm
from linen_models import pipeline
from linen_models.olmo2 import Olmo2DecoderLayer, Olmo3Block
from linen_models.qwen3_moe import Qwen3MoeDecoderLayer
from linen_models.qwen3_next import Qwen3NextBlock
from maxbridge.core import canonical
from maxbridge.core import pipeline_plan
from maxbridge.core.config import Config
from maxbridge.ops import linear
from maxbridge.ops import output_head
from maxbridge.ops import remat

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


def layer_classes(config: Config) -> dict[str, type[nn.Module]]:
  """Stack name -> layer class, by the kind of layer the family's stack holds."""
  return {stack.name: LAYER_CLASSES[stack.kind] for stack in config.family.stacks}


class Decoder(nn.Module):
  config: Config
  dot_general: linear.DotGeneral = jax.lax.dot_general  # the tied head's matmul

  @nn.compact
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
    dtypes = dict(dtype=jnp.dtype(cfg.dtype), weight_dtype=jnp.dtype(cfg.weight_dtype))
    embedded = x  # multi-token prediction embeds later tokens like this, without positions
    if cfg.trainable_position_size:
      x = x + Embed(cfg.trainable_position_size, cfg.emb_dim, name="position_embedder", **dtypes)(positions)
    classes = layer_classes(cfg)
    plan = pipeline_plan.pipeline_plan(cfg)
    if cfg.family.layer_carry:
      x = LAYER_CARRIES[cfg.family.layer_carry](cfg, name="per_layer_inputs")(x, tokens)
    per_stack = []
    for name, count in canonical.layer_stacks(cfg):
      layer = classes[name]
      pipelined = plan is not None and name == plan.stack
      # Initialising only declares the stack's parameters; decoding (a cache) runs it unpipelined.
      if pipelined and not self.is_initializing() and not self.is_mutable_collection("cache"):
        x, outputs = pipeline.run(layer, self.variables["params"][name], cfg, plan, x, positions, segment_ids)
        per_stack.append(outputs)
        continue
      if cfg.remat_policy != "none":
        # prevent_cse only matters outside scan, where XLA could otherwise merge
        # the recomputation back into the forward pass.
        layer = nn.remat(layer, policy=remat.checkpoint_policy(cfg.remat_policy), prevent_cse=not cfg.scan_layers)
      if cfg.scan_layers:
        stack = nn.scan(
            layer,
            # Layer state other than parameters (caches, what a layer sows) is
            # per layer too; it stacks on axis 0, as MaxText's does.
            variable_axes={"params": cfg.param_scan_axis, "cache": 0, "intermediates": 0},
            split_rngs={"params": True},
            in_axes=(nn.broadcast, nn.broadcast),
            length=count,
            metadata_params={nn.PARTITION_NAME: canonical.layer_axis(cfg, name)},
        )
        x, outputs = stack(cfg, name=name)(x, positions, segment_ids)
      else:
        layer_outputs = []
        for i in range(count):
          x, out = layer(cfg, name=f"{name}_{i}")(x, positions, segment_ids)
          layer_outputs.append(out)
        outputs = canonical.stack_layer_values(layer_outputs)
      per_stack.append(outputs)
    if cfg.family.layer_carry:
      x = x["x"]
    per_layer = canonical.concat_layer_stacks(per_stack)
    for key, value in per_layer.items():
      self.sow("intermediates", key, value)
    if "moe_lb_losses" in per_layer:  # what the training loss adds: the mean over MoE layers
      self.sow("intermediates", "moe_lb_loss", jnp.mean(per_layer["moe_lb_losses"]))
    # Before the final norm, which belongs to the output head: vocabulary
    # tiling runs that head itself, tile by tile.
    self.sow("intermediates", "hidden_states", x)
    project = None  # tied: `embedding` projects
    if not cfg.logits_via_embedding:
      project = dense(cfg, (cfg.emb_dim,), (cfg.vocab_size,), ("embed", "vocab"), name="logits_dense")
    final_norm = norm(cfg, name="decoder_norm")

    def head(h, norm=final_norm):
      return output_head.output_logits(
          h,
          norm=norm,
          project=project,
          embedding=embedding,
          dtype=jnp.dtype(cfg.dtype),
          dot_general=self.dot_general,
          normalize_embedding_logits=cfg.normalize_embedding_logits,
          final_logits_soft_cap=cfg.final_logits_soft_cap,
      )

    logits = head(x)
    # Training only: decoding (a cache) predicts the next token alone.
    # (A cache collection may be mutable yet empty, as behind ToNNX: what counts is whether one was given.)
    if cfg.mtp_num_layers and not jax.tree.leaves(self.variables.get("cache", {})):
      layer = classes[cfg.family.mtp_stack(cfg).name]
      hidden = MTPBlock(cfg, layer, name="mtp")(x, embedded, positions, segment_ids)
      # Each module's hidden states come normed by its own head_norm (DeepSeek-V3's shared_head.norm).
      self.sow("intermediates", "mtp_logits", jnp.stack([head(h, norm=lambda h: h) for h in hidden]))  # [K, B, T, V]
    return logits
