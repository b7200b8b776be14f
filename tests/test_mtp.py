"""Multi-token prediction (mtp_num_layers): DeepSeek-V3's modules on both backends, against a hand computation."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxbridge as mb
from maxbridge.core import canonical, checkpointing, step_folder
from maxbridge.core.config import ConfigError
from maxbridge.models import decoding
from maxbridge.training import data, recipe
from maxbridge.training.loss import CrossEntropy, Forward
from linen_models.llama import DecoderLayer
from conftest import tiny_config

LINEN, NNX = (False, False, False), (True, True, True)
BRIDGED = (True, True, False)  # an NNX model around a Linen decoder (ToNNX)


@pytest.fixture(autouse=True)
def highest_precision():
  with jax.default_matmul_precision("highest"):
    yield


def deepseek_config(flags, **overrides):
  options = dict(zip(("pure_nnx", "enable_nnx", "pure_nnx_decoder"), flags))
  options.update(mtp_num_layers=1, mtp_loss_scaling_factor=0.3, mtp_eval_target_module=1, steps=4)
  options.update(learning_rate=1e-2, warmup_steps_fraction=0.0, eval_interval=0)
  return mb.load_config("deepseek3-tiny", **{**options, **overrides})


@pytest.fixture(scope="module")
def deepseek():
  """Per backend: its trainer, one batch, and the loss, MTP metrics and canonical gradients at the seed-0 state,
  through the trainer's own loss."""
  out = {}
  for name, flags in {"linen": LINEN, "nnx": NNX}.items():
    config = deepseek_config(flags)
    trainer = recipe.create_trainer(config)
    batch = data.make_dataset(config, "train", 4).batch(0)
    state = trainer.init_state(0)

    @jax.jit
    def value_and_grad(state, batch):
      bound = trainer._bind(state)  # noqa: B023 (called in this iteration)
      return jax.value_and_grad(lambda p: trainer._loss(bound, p, batch), has_aux=True)(bound.params)  # noqa: B023

    (loss, aux), grads = jax.device_get(value_and_grad(state, trainer.shard_batch(batch)))
    grads = canonical.flatten(canonical.unstack_layers(canonical.unflatten(canonical.flatten(grads)), 1))
    out[name] = dict(config=config, trainer=trainer, loss=loss, aux=aux, grads=grads)
  return out


def test_deepseek_linen_and_nnx_give_the_same_mtp_loss_and_gradients(deepseek):
  linen, nnx = deepseek["linen"], deepseek["nnx"]
  assert float(linen["aux"]["mtp_loss"]) > 0
  for key in ("tokens", "mtp_loss", "mtp_acceptance_rate"):
    np.testing.assert_allclose(nnx["aux"][key], linen["aux"][key], rtol=1e-6, err_msg=key)
  np.testing.assert_allclose(nnx["loss"], linen["loss"], rtol=1e-6)
  assert sorted(nnx["grads"]) == sorted(linen["grads"])
  mtp_paths = [path for path in linen["grads"] if path.startswith("decoder/mtp/mtp_layer_1/")]
  assert "decoder/mtp/mtp_layer_1/projection/kernel" in mtp_paths
  assert "decoder/mtp/mtp_layer_1/layer/DeepSeekMoeBlock_0/MoeBlock_0/wi_0" in mtp_paths  # an MoE layer, as V3's
  for path, want in linen["grads"].items():
    np.testing.assert_allclose(nnx["grads"][path], want, atol=1e-6, rtol=1e-5, err_msg=path)
  assert np.abs(linen["grads"]["decoder/mtp/mtp_layer_1/projection/kernel"]).max() > 0


def test_deepseek_mtp_trains_and_a_linen_run_resumed_with_nnx_flags_continues_the_same_losses(deepseek, tmp_path):
  def run(name, backend, **options):
    config = deepseek[backend]["config"].replace(base_output_directory=str(tmp_path), run_name=name)
    return mb.train(config, trainer=deepseek[backend]["trainer"], progress=False, **options)

  whole = run("whole", "linen")
  assert whole[-1]["loss"] < whole[0]["loss"] - 0.05, whole
  assert whole[-1]["mtp_loss"] < whole[0]["mtp_loss"], whole  # the MTP module learns too
  assert all(0 <= r["mtp_acceptance_rate"] <= 1 for r in whole)
  run("flip", "linen", until_step=2)
  resumed = run("flip", "nnx")  # NNX restores the mtp subtree (and its optimizer state) from Linen's checkpoint
  assert [r["step"] for r in resumed] == [2, 3]
  np.testing.assert_allclose([r["loss"] for r in resumed], [r["loss"] for r in whole[2:]], rtol=1e-5)
  np.testing.assert_allclose([r["mtp_loss"] for r in resumed], [r["mtp_loss"] for r in whole[2:]], rtol=1e-5)


# llama-tiny, bridged, with two chained modules: a packed batch (two sequences in row 0) with a padded tail (row 1).
SEGMENTS = np.array([[1] * 10 + [2] * 6, [1] * 12 + [0] * 4], np.int32)


def llama_batch(config):
  rng = np.random.default_rng(0)
  tokens = rng.integers(1, config.vocab_size, (2, 17)).astype(np.int32)
  positions = np.concatenate([np.arange(10), np.arange(6)])[None].repeat(2, 0).astype(np.int32)
  positions[1] = np.arange(16)
  segments = jnp.asarray(SEGMENTS)
  batch = dict(inputs=tokens[:, :-1], targets=tokens[:, 1:], inputs_position=positions)
  batch = {key: jnp.asarray(value) for key, value in batch.items()}
  return {**batch, "inputs_segmentation": segments, "targets_segmentation": segments}


def mean_loss(model, loss, batch, params=None):
  params = model.params() if params is None else params
  forward = Forward(lambda p, _, *inputs: model.apply_with_intermediates(p, *inputs), params, None)
  value, aux = jax.jit(lambda batch: loss(forward, batch))(batch)
  return value / aux["tokens"], aux


@pytest.fixture(scope="module")
def llama():
  config = tiny_config(BRIDGED, mtp_num_layers=2, mtp_loss_scaling_factor=0.5)
  return config, mb.create_model(config, seed=0), llama_batch(config)


def _rms_norm(x, scale, epsilon):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + epsilon) * scale


def test_mtp_rows_never_see_later_tokens(llama):
  """Module k's row i reads tokens up to i + k alone: a new last token leaves every earlier row's logits as they were
  (rows past the end once sat at position 0, which every row's attention saw)."""
  config, model, batch = llama
  inputs = batch["inputs"][1:]
  changed = inputs.at[:, -1].set((inputs[:, -1] + 1) % config.vocab_size)
  _, before = model.apply_with_intermediates(model.params(), inputs)
  _, after = model.apply_with_intermediates(model.params(), changed)
  length = inputs.shape[1]
  for k in (1, 2):
    rows = length - 1 - k  # row i < rows reads tokens before the last
    np.testing.assert_allclose(
        after["decoder/mtp_logits"][k - 1][:, :rows], before["decoder/mtp_logits"][k - 1][:, :rows], atol=1e-6
    )
    assert not np.allclose(after["decoder/mtp_logits"][k - 1][:, rows], before["decoder/mtp_logits"][k - 1][:, rows])


def test_llama_mtp_loss_equals_a_hand_computation_over_the_canonical_params(llama):
  config, model, batch = llama
  params = model.params()
  # Each module's own final norm (DeepSeek-V3's shared_head.norm), drawn apart from the decoder's and each other's.
  for k, key in ((1, 1), (2, 2)):
    head_norm = params["decoder"]["mtp"][f"mtp_layer_{k}"]["head_norm"]
    head_norm["scale"] = jax.random.uniform(jax.random.key(key), head_norm["scale"].shape, minval=0.5, maxval=1.5)
  value, aux = mean_loss(model, CrossEntropy(mtp_loss_scaling_factor=0.5), batch, params)
  logits, intermediates = model.apply_with_intermediates(
      params, batch["inputs"], batch["inputs_position"], batch["inputs_segmentation"]
  )

  eps, decoder = config.normalization_layer_epsilon, params["decoder"]
  table = params["token_embedder"]["embedding"]
  hidden = intermediates["decoder/hidden_states"]  # the main decoder's last hidden states, before the final norm
  inputs, positions, segments = (np.asarray(batch[key]) for key in ("inputs", "inputs_position", "inputs_segmentation"))
  targets, length = np.asarray(batch["targets"]), inputs.shape[1]
  sums = counts = 0.0
  for k in (1, 2):
    mtp = decoder["mtp"][f"mtp_layer_{k}"]
    # Token i + k at position i (zeros past the end), at position i's + k: later than every earlier row.
    later = np.zeros_like(inputs)
    later[:, : length - k] = inputs[:, k:]
    embedded = table[later] * (np.arange(length) < length - k)[None, :, None]
    later_positions = positions + k
    both = jnp.concatenate(
        [_rms_norm(hidden, mtp["hidden_norm"]["scale"], eps), _rms_norm(embedded, mtp["embedding_norm"]["scale"], eps)],
        -1,
    )
    x = both @ mtp["projection"]["kernel"]
    hidden, _ = DecoderLayer(config).apply({"params": mtp["layer"]}, x, later_positions, segments)
    # The module's own final norm, then the shared head; the next module reads the un-normed hidden states.
    mtp_logits = _rms_norm(hidden, mtp["head_norm"]["scale"], eps) @ decoder["logits_dense"]["kernel"]
    log_probs = np.asarray(jax.nn.log_softmax(mtp_logits, -1))
    for row in range(2):
      for i in range(length - k):
        # Predicts token i + k + 1, where it is a real target of the same packed sequence as position i.
        if SEGMENTS[row, i + k] == SEGMENTS[row, i] != 0:
          sums -= log_probs[row, i, targets[row, i + k]]
          counts += 1
  want_mtp = 0.5 * sums / counts
  mask = SEGMENTS != 0
  main = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), batch["targets"][..., None], -1)[..., 0]
  want_main = float(jnp.sum(main * mask) / mask.sum())
  np.testing.assert_allclose(aux["mtp_loss"] / aux["tokens"], want_mtp, rtol=1e-5)
  np.testing.assert_allclose(value, want_main + want_mtp, rtol=1e-5)


def test_mtp_off_is_todays_model_and_a_zero_scaling_factor_leaves_the_plain_loss(llama):
  config, model, batch = llama
  plain = mb.create_model(config.replace(mtp_num_layers=0), seed=0)
  with_mtp, without = canonical.flatten(model.params()), canonical.flatten(plain.params())
  assert sorted(without) == sorted(path for path in with_mtp if not path.startswith("decoder/mtp/"))
  for path, value in without.items():  # parameters are drawn by canonical path: the same model, plus the modules
    np.testing.assert_array_equal(with_mtp[path], value, err_msg=path)
  assert plain.config.mtp_num_layers == mb.load_config("llama-tiny").mtp_num_layers == 0  # off by default

  want, want_aux = mean_loss(plain, CrossEntropy(), batch)
  got, got_aux = mean_loss(model, CrossEntropy(mtp_loss_scaling_factor=0.0), batch)
  assert "mtp_loss" not in want_aux and float(got_aux["mtp_loss"]) == 0.0
  np.testing.assert_allclose(got, want, rtol=1e-6)  # equal but for rounding: XLA fuses two programs differently


def test_a_cached_forward_skips_the_modules_and_keeps_the_main_logits(llama):
  config, model, batch = llama
  prompt, params = batch["inputs"][:, :6], model.params()
  positions, segments = batch["inputs_position"][:, :6], jnp.ones_like(prompt)
  cache = decoding.init_cache(config, 2, 8)
  logits, new_cache = jax.jit(model.cached_forward)(params, cache, prompt, positions, segments)
  assert sorted(canonical.flatten(new_cache)) == sorted(canonical.flatten(cache))  # no cache for the modules
  np.testing.assert_allclose(logits, model.apply(params, prompt, positions, segments), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(mtp_num_layers=-1), "mtp_num_layers"),
        (dict(mtp_num_layers=1, mtp_eval_target_module=2), "mtp_eval_target_module=2 names no module"),
        (dict(mtp_num_layers=1, num_vocab_tiling=2), "mtp_num_layers=1 with num_vocab_tiling > 1"),
        (dict(mtp_num_layers=1, use_qk_clip=True), "mtp_num_layers=1 with use_qk_clip=true"),
    ],
)
def test_what_mtp_cannot_run_is_refused_naming_the_keys(overrides, message):
  with pytest.raises(ConfigError, match=message):
    tiny_config(**overrides)


def test_a_family_of_blocks_is_refused():
  with pytest.raises(ConfigError, match="decoder_block='gemma2' stacks blocks of 2 layers .* an MTP module holds one"):
    mb.load_config("gemma2-tiny", mtp_num_layers=1)


def test_deepseek_mtp_layers_round_trip_through_a_hugging_face_folder(tmp_path):
  """Export writes DeepSeek-V3's layout (module k as model.layers.{num_hidden_layers + k - 1}: enorm, hnorm,
  eh_proj, a decoder layer, its own shared_head.norm, copies of the embedding and head); import reads it back
  exactly."""
  import json

  from safetensors.numpy import load_file, save_file

  from maxbridge.interop.hf import HFError
  from maxbridge.interop.hf.folders import load_hf, save_hf

  config = mb.load_config("deepseek3-tiny", mtp_num_layers=2)
  params = mb.create_model(config, seed=3).params()
  folder = save_hf(params, config, tmp_path / "hf")
  assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 2
  tensors = load_file(folder / "model.safetensors")
  first = config.num_decoder_layers  # module 1
  flat = canonical.flatten(canonical.unstack_layers(params, config.param_scan_axis))
  np.testing.assert_array_equal(
      tensors[f"model.layers.{first + 1}.hnorm.weight"], flat["decoder/mtp/mtp_layer_2/hidden_norm/scale"]
  )
  # eh_proj reads [embedding; hidden], our projection [hidden; embedding]: the same map.
  hidden, embedded = np.random.default_rng(0).normal(size=(2, config.emb_dim)).astype(np.float32)
  np.testing.assert_allclose(
      tensors[f"model.layers.{first}.eh_proj.weight"] @ np.concatenate([embedded, hidden]),
      np.concatenate([hidden, embedded]) @ flat["decoder/mtp/mtp_layer_1/projection/kernel"],
      rtol=1e-5,
      atol=1e-6,
  )
  np.testing.assert_array_equal(
      tensors[f"model.layers.{first}.shared_head.norm.weight"], flat["decoder/mtp/mtp_layer_1/head_norm/scale"]
  )
  np.testing.assert_array_equal(tensors[f"model.layers.{first}.shared_head.head.weight"], tensors["lm_head.weight"])

  loaded_config, loaded = load_hf(folder)
  assert loaded_config.mtp_num_layers == 2  # read off the stored layers
  got = canonical.flatten(loaded)
  assert sorted(got) == sorted(flat)
  for path, want in flat.items():
    np.testing.assert_array_equal(got[path], want, err_msg=path)

  # mtp_num_layers=0 leaves the stored MTP layers out, as transformers does.
  main_config, main = load_hf(folder, "mtp_num_layers=0")
  assert main_config.mtp_num_layers == 0 and not any("mtp" in path for path in canonical.flatten(main))

  # DeepSeek-V3's checkpoints hold a shared_head.norm of other values than model.norm: the module's own final
  # norm, read in and written back.
  own_norm = np.random.default_rng(1).uniform(0.5, 1.5, config.emb_dim).astype(np.float32)
  tensors[f"model.layers.{first}.shared_head.norm.weight"] = own_norm
  save_file(tensors, folder / "model.safetensors")
  _, loaded = load_hf(folder)
  np.testing.assert_array_equal(canonical.flatten(loaded)["decoder/mtp/mtp_layer_1/head_norm/scale"], own_norm)
  again = load_file(save_hf(loaded, loaded_config, tmp_path / "again") / "model.safetensors")
  assert sorted(again) == sorted(tensors)
  for name, want in tensors.items():
    np.testing.assert_array_equal(again[name], want, err_msg=name)

  # Its shared_head.head is the model's lm_head (README_WEIGHTS: shared with the main model): one of other values
  # is refused by name.
  tensors[f"model.layers.{first}.shared_head.head.weight"] = tensors["lm_head.weight"] + 1
  save_file(tensors, folder / "model.safetensors")
  with pytest.raises(HFError, match=rf"model\.layers\.{first}\.shared_head\.head\.weight differs.*mtp_num_layers=0"):
    load_hf(folder)


def _without_head_norms(tree):
  if isinstance(tree, dict):
    return {key: _without_head_norms(value) for key, value in tree.items() if key != "head_norm"}
  if hasattr(tree, "_fields"):  # an optax state
    return type(tree)(*map(_without_head_norms, tree))
  if isinstance(tree, (tuple, list)):
    return type(tree)(map(_without_head_norms, tree))
  return tree


def test_a_checkpoint_saved_before_each_module_had_its_own_norm_restores_decoder_norm_in_its_place(llama, tmp_path):
  config = llama[0]
  target = recipe.create_trainer(config).checkpoint_target()
  rng = np.random.default_rng(0)
  state = jax.tree.map(lambda leaf: rng.standard_normal(leaf.shape).astype(leaf.dtype), target)
  old = checkpointing.Checkpointer(tmp_path / "old")  # the tree an MTP run saved before head_norm existed
  old.save(2, _without_head_norms(state))
  old.wait()
  restored = step_folder.stored_paths(old.restore(2, target))
  saved = step_folder.stored_paths(state)
  copied = [path for path in saved if "/head_norm/" in path]
  assert len(copied) == 3 * config.mtp_num_layers  # each module's norm, in the parameters and in Adam's mu and nu
  for path in saved:
    source = re.sub(r"mtp/mtp_layer_\d+/head_norm", "decoder_norm", path)
    np.testing.assert_array_equal(restored[path], saved[source], err_msg=path)
  model = llama[1]  # parameters alone (load_parameters_path, generate) load the same way
  loaded = canonical.flatten(canonical.conform(_without_head_norms(model.params()), model.abstract_params(), 1))
  for k in range(1, config.mtp_num_layers + 1):
    np.testing.assert_array_equal(
        loaded[f"decoder/mtp/mtp_layer_{k}/head_norm/scale"], loaded["decoder/decoder_norm/scale"]
    )
