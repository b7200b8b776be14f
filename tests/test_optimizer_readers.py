"""Every optimizer's state is readable by every reader (issue 47, item 1).

A Muon run's state is a partition of chains (`opt_state/inner_states/adam/inner_state/0/mu/...`), not AdamW's
numbered chain: generate, export-hf, convert, `mb.from_pretrained`, `load_parameters_path` and `verify` all read
it; readers of parameters never parse the optimizer state at all; and any optax state (a chain, a bare state, a
partition, injected hyperparameters) converts Linen <-> NNX and scanned <-> unscanned exactly.
"""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import converters
import maxbridge as mb
from maxbridge import cli
from maxbridge.core import canonical, checkpointing, layouts
from conftest import LINEN_FLAGS, tiny_config

NNX_ARGS = ["pure_nnx=true", "enable_nnx=true", "pure_nnx_decoder=true"]
# A leaf only a partition of chains has: the Muon half's momentum of a scanned attention kernel.
MUON_LEAF = "opt_state/inner_states/muon/inner_state/0/mu/params/decoder/layers/self_attention/query/kernel"


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
  """A 2-step Muon run (llama-tiny, Linen, scanned) with checkpoints at steps 1 and 2."""
  base = tmp_path_factory.mktemp("muon")
  config = tiny_config(
      base_output_directory=str(base),
      run_name="muon",
      opt_type="muon",
      steps=2,
      per_device_batch_size=2,
      checkpoint_period=1,
      eval_interval=0,
  )
  mb.train(config, progress=False)
  return base / "muon"


def _cli(capsys, *argv) -> tuple[int, str, str]:
  code = cli.main([str(a) for a in argv])
  out, err = capsys.readouterr()
  return code, out, err


def _stored_params(path) -> dict[str, np.ndarray]:
  reader = checkpointing.CheckpointReader(path)
  return {p[len("params/params/") :]: reader.read(p) for p in reader.leaves if p.startswith("params/params/")}


def test_verify_finds_a_muon_runs_checkpoints_intact(run, capsys):
  code, out, err = _cli(capsys, "verify", run)
  assert code == 0, out + err
  assert out.count(": ok: ") == 2 and "damaged" not in out, out
  assert MUON_LEAF in checkpointing.CheckpointReader(run).leaves


def test_from_pretrained_and_generate_read_a_muon_run(run, capsys):
  model = mb.from_pretrained(run)
  stored = _stored_params(run)
  got = canonical.flatten(jax.tree.map(np.asarray, model.params()))
  assert got.keys() == stored.keys()
  for path, array in stored.items():
    np.testing.assert_array_equal(got[path], array, err_msg=path)
  code, out, err = _cli(capsys, "generate", run, "--prompt", "hi", "--max-new-tokens", "4")
  assert code == 0, err


def test_export_hf_of_a_muon_run_holds_its_parameters(run, tmp_path, capsys):
  code, out, err = _cli(capsys, "export-hf", run, tmp_path / "hf")
  assert code == 0, err
  exported = mb.from_pretrained(tmp_path / "hf", "linen", scan_layers=True)
  got = canonical.flatten(jax.tree.map(np.asarray, exported.params()))
  for path, array in _stored_params(run).items():
    np.testing.assert_array_equal(got[path], array, err_msg=path)


def test_a_muon_checkpoint_converts_to_nnx_unscanned_and_back_exactly(run, tmp_path, capsys):
  nnx = tmp_path / "nnx"
  code, out, err = _cli(capsys, "convert", run, nnx, "--layout", "nnx", "--scan-layers", "false")
  assert code == 0, err
  assert "nnx layout" in out and "unscanned" in out, out
  stored = checkpointing.CheckpointReader(nnx).stored
  # NNX's optimizer sees the model's State: no Linen "params" level above the parameter's path.
  assert "optimizer/opt_state/inner_states/muon/inner_state/0/mu/decoder/layers_1/self_attention/query/kernel" in stored
  assert _cli(capsys, "verify", nnx)[0] == 0
  back = tmp_path / "back"
  code, out, err = _cli(capsys, "convert", nnx, back, "--layout", "linen", "--scan-layers", "true")
  assert code == 0, err
  code, out, err = _cli(capsys, "compare", run / "checkpoints" / "2", back)
  assert code == 0 and "equal: 35 arrays" in out, out + err


def test_training_resumes_from_a_muon_checkpoint_converted_to_nnx_unscanned(run, tmp_path, capsys):
  """The converted state is the NNX trainer's own: the resumed step 2 is the source's (its update used the
  optimizer state converted)."""
  new = tmp_path / "new"
  code, _, err = _cli(
      capsys, "convert", run / "checkpoints" / "1", new / "checkpoints", "--layout", "nnx", "--scan-layers", "false"
  )
  assert code == 0, err
  config = mb.load_config(str(new / "config.yml"), *NNX_ARGS)
  assert [r["step"] for r in mb.train(config, progress=False)] == [1]
  code, out, err = _cli(capsys, "compare", run / "checkpoints" / "2", new / "checkpoints" / "2", "--atol", "1e-5")
  assert code == 0, out + err


def test_a_muon_run_starts_another_run_through_load_parameters_path(run, tmp_path, capsys):
  """An AdamW run from a Muon run's parameters (as a LoRA base, a DPO reference or a teacher is read); with a
  learning rate of 0 its step-1 parameters are those it loaded."""
  config = mb.load_config(
      "llama-tiny",
      base_output_directory=str(tmp_path),
      run_name="student",
      load_parameters_path=str(run / "checkpoints" / "2"),
      learning_rate=0.0,
      steps=1,
      per_device_batch_size=2,
      checkpoint_period=1,
      eval_interval=0,
      **LINEN_FLAGS,
  )
  mb.train(config, progress=False)
  code, out, err = _cli(capsys, "compare", "--params-only", run, tmp_path / "student")
  assert code == 0, out + err


def test_load_full_state_path_continues_a_muon_runs_optimizer_on_another_backend_and_scan_form(run, tmp_path, capsys):
  """A new NNX, unscanned run from the Linen, scanned Muon run's step 1 (parameters, both halves' momenta, step):
  its step 2 is the source's, so Muon's masked momentum was read and restacked, not refused or reset."""
  config = mb.load_config(
      "llama-tiny",
      *NNX_ARGS,
      base_output_directory=str(tmp_path),
      run_name="again",
      opt_type="muon",
      scan_layers=False,
      load_full_state_path=str(run / "checkpoints" / "1"),
      steps=2,
      per_device_batch_size=2,
      checkpoint_period=1,
      eval_interval=0,
  )
  assert [r["step"] for r in mb.train(config, progress=False)] == [1]
  code, out, err = _cli(
      capsys, "compare", run / "checkpoints" / "2", tmp_path / "again" / "checkpoints" / "2", "--atol", "1e-5"
  )
  assert code == 0, out + err


def test_parameter_readers_never_parse_the_optimizer_state(tmp_path):
  """A state no layout knows stops the readers of the whole state, naming its path; not those of parameters."""
  params = {"token_embedder": {"embedding": np.arange(32, dtype=np.float32).reshape(8, 4)}}
  ckpt = checkpointing.Checkpointer(tmp_path / "odd")
  ckpt.save(1, {"model": params, "optimizer": {"shadow": {"x": np.ones(3, np.float32)}}})
  ckpt.close()
  tree, info = checkpointing.load_params(tmp_path / "odd")
  np.testing.assert_array_equal(tree["token_embedder"]["embedding"], params["token_embedder"]["embedding"])
  assert info.layout.kind == layouts.NNX
  with pytest.raises(checkpointing.CheckpointError, match="unexpected path optimizer/shadow/x in a nnx checkpoint"):
    checkpointing.CheckpointReader(tmp_path / "odd")


# --- any optax state, on disk and in memory ------------------------------------------------------------------


PARAMS = {
    "token_embedder": {"embedding": (8, 4)},
    "decoder": {
        "layers": {"mlp": {"wi": {"kernel": (4, 2, 6)}}, "norm": {"scale": (4, 2)}},  # 2 layers on axis 1
        "decoder_norm": {"scale": (4,)},
    },
}


def _by_group(params):
  return jax.tree_util.tree_map_with_path(lambda k, _: "m" if "mlp" in layouts.keypath_str(k) else "a", params)


OPTIMIZERS = {
    "chain": lambda: optax.adamw(1e-3),
    "bare state": optax.scale_by_adam,  # no numbered level at all
    "partition": lambda: optax.multi_transform({"a": optax.adam(1e-3), "m": optax.sgd(1e-3, momentum=0.9)}, _by_group),
    "injected": lambda: optax.inject_hyperparams(optax.adamw)(learning_rate=1e-3),
    "muon": lambda: optax.contrib.muon(1e-3),
}


def _state(tx, params, seed=0):
  """A train state in the linen layout, every floating leaf a distinct random value."""
  rng = np.random.default_rng(seed)
  tree = {"params": {"params": params}, "opt_state": layouts.optax_to_tree(tx.init({"params": params})), "step": 3}
  return jax.tree.map(
      lambda x: rng.standard_normal(np.shape(x)).astype(np.float32)
      if jnp.issubdtype(jnp.result_type(x), jnp.floating)
      else np.asarray(x, np.int32),
      tree,
  )


def _same(got, want):
  got, want = layouts.flatten_tree(got), layouts.flatten_tree(want)
  assert got.keys() == want.keys(), sorted(set(got) ^ set(want))
  for path in want:
    np.testing.assert_array_equal(np.asarray(got[path]), np.asarray(want[path]), err_msg=path)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_any_optax_state_converts_between_layouts_and_scan_forms_exactly(name, tmp_path):
  tx = OPTIMIZERS[name]()
  params = jax.tree.map(lambda shape: jnp.zeros(shape, jnp.float32), PARAMS, is_leaf=lambda x: isinstance(x, tuple))
  tree = _state(tx, params)
  _same(converters.to_linen(converters.to_nnx(tree)), tree)
  unscanned = converters.to_linen(tree, scan_layers=False)
  _same(converters.to_linen(unscanned, scan_layers=True), tree)
  if name != "muon":  # optax's default Muon tells matrices by rank, so a stack and its layers train apart
    fresh = _state(tx, canonical.unstack_layers(params, 1))
    assert set(layouts.flatten_tree(unscanned)) == set(layouts.flatten_tree(fresh))

  ckpt = checkpointing.Checkpointer(tmp_path / "src")
  ckpt.save(3, tree)
  ckpt.close()
  converters.convert(tmp_path / "src", tmp_path / "nnx", layout="nnx", scan_layers=False)
  assert [c.damaged for c in converters.verify(tmp_path / "nnx")] == [[]]
  converters.convert(tmp_path / "nnx", tmp_path / "back", layout="linen", scan_layers=True)
  back = checkpointing.CheckpointReader(tmp_path / "back")
  _same(layouts.build_tree({p: back.read(p) for p in back.leaves}, layouts.LINEN), tree)
