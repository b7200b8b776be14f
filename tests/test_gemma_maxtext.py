"""MaxText's Gemma 2 checkpoints load as they are: its parameter names, its scanned and unscanned layouts, its yml keys.

The checkpoints are written by our own trainer with no config.yml beside them,
as `test_maxtext` builds MaxText's; what makes them MaxText's is the tree, which
is checked against the names MaxText's Gemma2DecoderLayer gives its modules.
"""

import jax
import numpy as np
import pytest
from flax import nnx

import maxbridge as mb
from maxbridge.core import canonical, checkpointing
from maxbridge.core.config import ConfigError
from maxbridge.training import recipe

# MaxText's keys that maxbridge accepts at the values it computes are reported as ignored (checked below).
pytestmark = pytest.mark.filterwarnings("ignore:ignoring MaxText config keys")

LINEN = dict(pure_nnx=False, enable_nnx=False, pure_nnx_decoder=False)
NNX = dict(pure_nnx=True, enable_nnx=True, pure_nnx_decoder=True)

# MaxText's configs/models/gemma2-2b.yml, every key as it is there but the sizes (tiny here).
MAXTEXT_GEMMA2 = """\
base_emb_dim: 64
base_num_query_heads: 4
base_num_kv_heads: 2
base_mlp_dim: 128
base_num_decoder_layers: 2 # half of the real number of layers because we merge [local_attention, global_attention] into one layer
head_dim: 16
mlp_activations: ["gelu","linear"]
vocab_size: 256
decoder_block: "gemma2"
normalization_layer_epsilon: 1.e-06
logits_via_embedding: True
final_logits_soft_cap: 30.0
attn_logits_soft_cap: 50.0
sliding_window_size: 4
use_post_attn_norm: True
use_post_ffw_norm: True
"""

# The modules of MaxText's Gemma2DecoderLayer (layers/gemma2.py), each kernel or scale under it.
_SUBLAYER = (
    "pre_self_attention_norm_{sub}/scale",
    "self_attention_{sub}/query/kernel",
    "self_attention_{sub}/key/kernel",
    "self_attention_{sub}/value/kernel",
    "self_attention_{sub}/out/kernel",
    "post_self_attention_norm_{sub}/scale",
    "pre_ffw_norm_{sub}/scale",
    "mlp_{sub}/wi_0/kernel",
    "mlp_{sub}/wi_1/kernel",
    "mlp_{sub}/wo/kernel",
    "post_ffw_norm_{sub}/scale",
)
MAXTEXT_LAYER = sorted(path.format(sub=sub) for sub in ("local", "global") for path in _SUBLAYER)


def maxtext_paths(layers: list[str]) -> list[str]:
  """MaxText's gemma2 parameter paths (tied head: no logits_dense) with `layers` its layer folders."""
  top = ["decoder/decoder_norm/scale", "token_embedder/embedding"]
  return sorted(top + [f"decoder/{layer}/{path}" for layer in layers for path in MAXTEXT_LAYER])


@pytest.fixture(scope="module")
def yml(tmp_path_factory):
  path = tmp_path_factory.mktemp("maxtext_yml") / "gemma2-tiny.yml"
  path.write_text(MAXTEXT_GEMMA2)
  return str(path)


@pytest.fixture(scope="module")
def checkpoints(yml, tmp_path_factory):
  """{name: (step folder, canonical params)}: MaxText's Linen layout scanned and unscanned, and an NNX one."""
  root = tmp_path_factory.mktemp("maxtext_gemma2")
  found = {}
  for name, flags, scanned in (("linen-scanned", LINEN, True), ("linen-unscanned", LINEN, False), ("nnx", NNX, False)):
    trainer = recipe.create_trainer(mb.load_config(yml, scan_layers=scanned, **flags))
    state = trainer.init_state(7)
    tree = nnx.to_pure_dict(state) if flags == NNX else trainer.to_checkpoint(state)
    ckpt = checkpointing.Checkpointer(root / name)
    ckpt.save(3, tree)
    ckpt.wait()
    ckpt.close()
    found[name] = (root / name / "3", jax.device_get(trainer.params(state)))
  assert not list(root.rglob("config.yml"))
  return found


def test_the_canonical_gemma2_tree_has_maxtexts_names(checkpoints):
  scanned = canonical.flatten(checkpoints["linen-scanned"][1])
  assert sorted(scanned) == maxtext_paths(["layers"])
  # MaxText's scan puts the layer axis at param_scan_axis=1: [emb_dim, blocks, heads, head_dim].
  assert scanned["decoder/layers/self_attention_local/query/kernel"].shape == (64, 2, 4, 16)
  assert sorted(canonical.flatten(checkpoints["linen-unscanned"][1])) == maxtext_paths(["layers_0", "layers_1"])
  assert sorted(canonical.flatten(checkpoints["nnx"][1])) == maxtext_paths(["layers_0", "layers_1"])


def test_hugging_face_layers_map_to_maxtexts_suffixed_modules_in_depth_order(yml):
  cfg = mb.load_config(yml)
  # Hugging Face's layers 0..3: block 0's local and global layer, then block 1's.
  assert canonical.layer_paths(cfg, "self_attention/query/kernel") == [
      f"decoder/layers_{block}/self_attention_{sub}/query/kernel" for block in (0, 1) for sub in ("local", "global")
  ]
  with pytest.raises(ValueError, match=r"stack 'layers' suffixes its sub-layers' module names.*pass `under`"):
    canonical.layer_paths(cfg)


@pytest.mark.parametrize(
    "backend,name", [("linen", "linen-scanned"), ("nnx", "linen-scanned"), ("linen", "linen-unscanned"), ("nnx", "nnx")]
)
def test_a_maxtext_gemma2_checkpoint_loads_with_its_yml(checkpoints, yml, tokens, backend, name):
  step_dir, params = checkpoints[name]
  model = mb.from_pretrained(step_dir, backend=backend, config=yml)
  assert model.config.decoder_block == "gemma2" and model.config.pure_nnx == (backend == "nnx")
  reference = mb.create_model(mb.load_config(yml, **(NNX if backend == "nnx" else LINEN)))
  reference.load_params(params)
  want = np.asarray(reference.logits(tokens))
  np.testing.assert_allclose(np.asarray(model.logits(tokens)), want, atol=1e-6)
  # The soft-cap and post-norms are in play: the logits are not a constant.
  assert float(np.std(want)) > 0 and float(np.abs(want).max()) < 30.0


def test_maxtexts_gemma_yml_keys_are_accepted_at_gemmas_values_only(yml):
  with pytest.warns(
      UserWarning, match=r"ignoring MaxText config keys.*: mlp_activations, use_post_attn_norm, use_post_ffw_norm$"
  ):
    cfg = mb.load_config(yml)  # at what gemma2 computes: accepted, each named
  assert (cfg.final_logits_soft_cap, cfg.attn_logits_soft_cap, cfg.sliding_window_size) == (30.0, 50.0, 4)
  assert mb.load_config("gemma-tiny", mlp_activations=["gelu", "linear"]).decoder_block == "gemma"
  with pytest.raises(
      ConfigError, match=r"'use_post_ffw_norm' = False .* use_post_ffw_norm=True with decoder_block='gemma2'"
  ):
    mb.load_config(yml, use_post_ffw_norm=False)
  with pytest.raises(ConfigError, match=r"'mlp_activations' = \['silu', 'linear'\] .* decoder_block='gemma2'"):
    mb.load_config(yml, mlp_activations=["silu", "linear"])
  # Gemma 1 has no post-norms, and Llama's MLP is SwiGLU.
  with pytest.raises(
      ConfigError, match=r"'use_post_attn_norm' = True .*use_post_attn_norm=False with decoder_block='gemma'"
  ):
    mb.load_config("gemma-tiny", use_post_attn_norm=True)
  with pytest.raises(ConfigError, match=r"'mlp_activations' = \['gelu', 'linear'\] .*decoder_block='llama2'"):
    mb.load_config("llama-tiny", mlp_activations=["gelu", "linear"])
