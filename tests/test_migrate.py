"""maxbridge.migrate on models written twice (tests/migrate_models.py): match, convert both ways, compare, CLI."""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn
from flax import nnx
from flax.training import train_state

import migrate_models as mm
from conftest import tiny_config
from maxbridge import cli, migrate

CASES = {case.name: case for case in mm.CASES}
ATOL = 1e-6
MODELS_FILE = os.path.join(os.path.dirname(__file__), "migrate_models.py")


@functools.cache
def built(name: str):
  """Linen module, inputs, variables, NNX twin and plan of one case, made once per session."""
  case = CASES[name]
  linen = case.linen()
  x = jax.random.normal(jax.random.key(1), case.input_shape)
  variables = linen.init(jax.random.key(0), x, **case.eval_kwargs)
  model = case.nnx(rngs=nnx.Rngs(0))
  return linen, x, variables, model, migrate.match(variables, model)


def _flat(tree):
  return {path: leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _assert_trees_close(a, b, atol, what):
  fa, fb = _flat(a), _flat(b)
  assert fa.keys() == fb.keys(), f"{what}: different structure"
  for path in fa:
    np.testing.assert_allclose(fa[path], fb[path], atol=atol, err_msg=f"{what} at {jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("name", CASES)
def test_twins_agree_after_conversion_both_directions(name):
  linen, x, variables, _, plan = built(name)
  plan.check()
  # NNX -> Linen: weights the NNX twin made itself become Linen variables; run on them, the two agree.
  # (Linen -> NNX is what `compare` itself does with them, and what the training test below resumes from.)
  other = CASES[name].nnx(rngs=nnx.Rngs(7))
  back = migrate.convert(plan, nnx_state=nnx.state(other)).variables
  result = migrate.compare(linen, other, (x,), variables=back, plan=plan, linen_kwargs=CASES[name].eval_kwargs)
  assert result.ok, str(result)
  # Both conversions are exact inverses.
  again = migrate.convert(plan, linen_variables=back).state
  _assert_trees_close(
      nnx.to_pure_dict(nnx.state(other, nnx.Not(nnx.RngState))),
      nnx.to_pure_dict(nnx.filter_state(again, nnx.Not(nnx.RngState))),
      0.0,
      "NNX -> Linen -> NNX",
  )
  there = migrate.convert(plan, linen_variables=variables).state
  _assert_trees_close(migrate.convert(plan, nnx_state=there).variables, variables, 0.0, "Linen -> NNX -> Linen")


def _linen_step(linen, tx, kwargs, variables, opt_state, x, y):
  mutable = [c for c in variables if c != "params"]

  def loss_fn(params):
    out, updates = linen.apply({**variables, "params": params}, x, **kwargs, mutable=mutable)
    return jnp.mean((out - y) ** 2), updates

  (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(variables["params"])
  changes, opt_state = tx.update(grads, opt_state, variables["params"])
  return loss, {**variables, **updates, "params": optax.apply_updates(variables["params"], changes)}, opt_state


def _nnx_step(model, optimizer, x, y):
  loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
  optimizer.update(model, grads)
  return loss


@pytest.mark.parametrize("name", CASES)
def test_optimizer_state_converts_and_training_resumes_with_the_same_losses(name):
  case = CASES[name]
  linen, x, variables, _, _ = built(name)
  y = jnp.ones_like(linen.apply(variables, x, **case.eval_kwargs))
  tx = optax.adam(1e-2)
  opt_state = tx.init(variables["params"])
  linen_step = jax.jit(functools.partial(_linen_step, linen, tx, case.train_kwargs))
  nnx_step = nnx.jit(_nnx_step)
  for _ in range(2):
    _, variables, opt_state = linen_step(variables, opt_state, x, y)
  model = case.nnx(rngs=nnx.Rngs(3))
  optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
  plan = migrate.match(variables, model)
  converted = migrate.convert(
      plan, linen_variables=variables, opt_state=opt_state, opt_template=optimizer.opt_state, step=2
  )
  nnx.update(model, converted.state)
  optimizer.opt_state = converted.opt_state
  optimizer.step[...] = converted.step
  # And back, exactly: the NNX optimizer state as Linen's.
  back = migrate.convert(plan, nnx_state=model, opt_state=optimizer.opt_state)
  _assert_trees_close(back.opt_state, opt_state, 0.0, "optimizer state Linen -> NNX -> Linen")
  _assert_trees_close(back.variables, variables, 0.0, "variables Linen -> NNX -> Linen")
  model.train()
  linen_losses, nnx_losses = [], []
  for _ in range(2):
    loss, variables, opt_state = linen_step(variables, opt_state, x, y)
    linen_losses.append(float(loss))
    nnx_losses.append(float(nnx_step(model, optimizer, x, y)))
  # Losses, not weights: Adam scales float noise in a zero gradient (attention's key bias) up to a full step.
  np.testing.assert_allclose(nnx_losses, linen_losses, rtol=1e-5, atol=1e-6)


def _bad_block_list(rngs):
  class ReluBlock(mm.NNXBlock):

    def __call__(self, x):
      x = x + self.attention(self.attention_norm(x))
      return x + self.down(nnx.relu(self.up(self.mlp_norm(x))))  # the Linen block uses gelu

  model = mm.NNXListTransformer(rngs=rngs)
  model.blocks = nnx.List([ReluBlock(rngs=rngs) for _ in range(mm.LAYERS)])
  return model


@pytest.mark.parametrize(
    "name, twin, linen_path, nnx_path, where",
    [
        ("mlp", lambda r: mm.NNXMLP(rngs=r, activation=nnx.gelu), "Dense_1", "fc2", "input"),
        ("mlp", lambda r: mm.NNXMLP(rngs=r, linear=mm.TransposedLinear), "Dense_1", "fc2", "output"),
        ("transformer-list", _bad_block_list, "blocks", "blocks", "stack"),
    ],
    ids=["swapped-activation", "transposed-kernel", "activation-in-a-scanned-block"],
)
def test_a_difference_in_the_twin_is_reported_at_its_submodule(name, twin, linen_path, nnx_path, where):
  linen, x, variables, _, _ = built(name)
  result = migrate.compare(linen, twin(nnx.Rngs(0)), (x,), variables=variables)
  assert not result.ok
  first = result.first_difference
  assert (first.linen_path, first.nnx_path, first.where) == (linen_path, nnx_path, where), str(result)
  assert first.max_abs > 1e-3


@pytest.mark.parametrize(
    "name, twin, named",
    [
        ("cnn", lambda r: mm.NNXCNN(rngs=r, conv_bias=False), "params/Conv_0/bias"),
        ("lstm", lambda r: mm.NNXLSTM(rngs=r, head_bias=False), "params/Dense_0/bias"),
        ("custom-collection", lambda r: mm.NNXShifted(rngs=r, extra=True), "gate (Param)"),
    ],
    ids=["cnn-conv-without-bias", "lstm-head-without-bias", "extra-nnx-param"],
)
def test_a_leaf_missing_from_the_twin_is_named(name, twin, named):
  _, _, variables, _, _ = built(name)
  plan = migrate.match(variables, twin(nnx.Rngs(0)))
  with pytest.raises(migrate.MigrateError, match="does not cover every leaf") as error:
    migrate.convert(plan, linen_variables=variables)
  # Only the missing leaf: its module's other leaves still match.
  assert named in str(error.value) and str(error.value).count("params/") <= 1, str(error.value)


@pytest.mark.parametrize("name", CASES)
def test_an_unmatched_leaf_is_an_error_naming_it(name):
  _, _, variables, model, plan = built(name)
  link = plan.links[-1]
  dropped = jax.tree.map(lambda v: v, variables)
  node = dropped
  for key in link.linen[0][:-1]:
    node = node[key]
  del node[link.linen[0][-1]]
  with pytest.raises(migrate.MigrateError) as error:
    migrate.match(dropped, model).check()
  # The NNX leaf left without a value is named: it would otherwise keep its initial value.
  assert "/".join(map(str, link.nnx[0])) in str(error.value), str(error.value)


class _TwoHeads(nn.Module):
  """Named submodules of one shape: nothing but their names tells them apart."""

  def setup(self):
    self.left = nn.Dense(4)
    self.right = nn.Dense(4)

  def __call__(self, x):
    return jnp.concatenate([self.left(x), 2.0 * self.right(x)], axis=-1)


class _TwoHeadsNNX(nnx.Module):

  def __init__(self, rngs):
    self.first = nnx.Linear(8, 4, rngs=rngs)
    self.second = nnx.Linear(8, 4, rngs=rngs)

  def __call__(self, x):
    return jnp.concatenate([self.first(x), 2.0 * self.second(x)], axis=-1)


class _FusedNNX(nnx.Module):

  def __init__(self, rngs):
    self.both = nnx.Linear(8, 8, rngs=rngs)

  def __call__(self, x):
    y = self.both(x)
    return jnp.concatenate([y[..., :4], 2.0 * y[..., 4:]], axis=-1)


def test_alike_submodules_with_unknown_order_are_ambiguous_until_a_rule_says(tmp_path):
  x = jnp.ones((2, 8))
  variables = _TwoHeads().init(jax.random.key(0), x)
  plan = migrate.match(variables, _TwoHeadsNNX(nnx.Rngs(0)))
  assert plan.ambiguous and "ambiguous" in str(plan)
  with pytest.raises(migrate.MigrateError, match="ambiguous: Linen \\['left', 'right'\\]"):
    plan.check()
  rules = tmp_path / "rules.yml"
  rules.write_text(
      "rules:\n  - {linen: 'params/left/(.*)', nnx: 'first/\\1'}\n  - {linen: 'params/right/(.*)', nnx: 'second/\\1'}\n"
  )
  result = migrate.compare(
      _TwoHeads(), _TwoHeadsNNX(nnx.Rngs(0)), (x,), variables=variables, rules=migrate.load_rules(str(rules))
  )
  assert result.ok, str(result)


class _Fused(nn.Module):

  @nn.compact
  def __call__(self, x):
    y = nn.Dense(8)(x)
    return jnp.concatenate([y[..., :4], 2.0 * y[..., 4:]], axis=-1)


def test_a_split_rule_maps_a_fused_linen_layer_onto_two_nnx_layers():
  x = jax.random.normal(jax.random.key(2), (2, 8))
  variables = _Fused().init(jax.random.key(0), x)
  rules = [
      {"linen": "params/Dense_0/kernel", "nnx": ["first/kernel", "second/kernel"], "split": -1},
      {"linen": "params/Dense_0/bias", "nnx": ["first/bias", "second/bias"], "split": 0},
  ]
  result = migrate.compare(_Fused(), _TwoHeadsNNX(nnx.Rngs(0)), (x,), variables=variables, rules=rules)
  assert result.ok, str(result)


def test_concat_and_transpose_rules_map_a_fused_twin_both_ways():
  x = jax.random.normal(jax.random.key(2), (2, 8))
  variables = _TwoHeads().init(jax.random.key(0), x)
  rules = [
      {"linen": ["params/left/kernel", "params/right/kernel"], "nnx": "both/kernel", "concat": -1},
      {"linen": ["params/left/bias", "params/right/bias"], "nnx": "both/bias", "concat": 0},
  ]
  plan = migrate.match(variables, _FusedNNX(nnx.Rngs(0)), rules)
  assert len(plan.transformed) == 2 and "concat axis -1" in str(plan)
  assert migrate.compare(_TwoHeads(), _FusedNNX(nnx.Rngs(0)), (x,), variables=variables, plan=plan).ok
  back = migrate.convert(plan, nnx_state=migrate.convert(plan, linen_variables=variables).state).variables
  _assert_trees_close(back, variables, 0.0, "Linen -> fused NNX -> Linen")
  # A kernel the twin stores as (out, in): a transpose rule.
  linen, x, variables, _, _ = built("mlp")
  twin = mm.NNXMLP(rngs=nnx.Rngs(0), linear=mm.TransposedLinear)
  rule = migrate.Rule(linen="params/Dense_1/kernel", nnx="fc2/kernel", transpose=(1, 0))
  assert migrate.compare(linen, twin, (x,), variables=variables, rules=[rule]).ok


class _Unrolled(nn.Module):
  named: bool

  @nn.compact
  def __call__(self, x):
    for i in range(12):
      x = nn.Dense(4, name=f"layers_{i}" if self.named else None)(x)
    return x


class _UnrolledNNX(nnx.Module):

  def __init__(self, rngs):
    self.layers = nnx.List([nnx.Linear(4, 4, rngs=rngs) for _ in range(12)])


@pytest.mark.parametrize("named", [True, False], ids=["layers_N", "Dense_N"])
def test_unrolled_linen_layers_match_an_nnx_list_in_order(named):
  variables = jax.eval_shape(_Unrolled(named).init, jax.random.key(0), jnp.ones((1, 4)))
  plan = migrate.match(variables, nnx.eval_shape(lambda: _UnrolledNNX(nnx.Rngs(0))))
  plan.check()
  pairs = {link.linen[0][1]: link.nnx[0][:2] for link in plan.links}
  assert pairs == {(f"layers_{i}" if named else f"Dense_{i}"): ("layers", i) for i in range(12)}, str(plan)


def test_rules_that_fit_nothing_are_named(tmp_path):
  _, _, variables, model, _ = built("mlp")
  with pytest.raises(migrate.MigrateError, match="no Linen path matches 'params/Dense_9/.*'"):
    migrate.match(variables, model, [{"linen": "params/Dense_9/.*", "nnx": "fc9"}])
  bad = tmp_path / "bad.yml"
  bad.write_text("rules:\n  - {linen: a, to: b}\n")
  with pytest.raises(migrate.MigrateError, match="rules\\[0\\]: a rule has keys linen, nnx"):
    migrate.load_rules(str(bad))


def test_our_own_families_match_with_no_rules():
  from maxbridge.models.dispatch import abstract_model

  linen = abstract_model(tiny_config())
  nnx_model = abstract_model(tiny_config((True, True, True))).module
  # Linen's variables in their LogicallyPartitioned boxes, against the NNX model's abstract state.
  plan = migrate.match({"params": linen.boxed_params()}, nnx_model)
  plan.check()
  assert plan.links and not plan.transformed, str(plan)
  assert all(link.linen[0][1:] == link.nnx[0] for link in plan.links), str(plan)


# ---------------------------------------------------------------- the command line


class _TrainState(train_state.TrainState):
  batch_stats: dict


def _linen_training_run(directory):
  """A plain Linen loop: flax's TrainState with BatchNorm statistics, saved with orbax."""
  linen = mm.linen_cnn()
  x = jax.random.normal(jax.random.key(1), (2, 8, 8, 1))
  y = jnp.ones((2, 10))
  variables = linen.init(jax.random.key(0), x, train=False)
  state = _TrainState.create(
      apply_fn=linen.apply, params=variables["params"], tx=optax.adam(1e-2), batch_stats=variables["batch_stats"]
  )

  @jax.jit
  def step(state):
    def loss_fn(params):
      out, updates = state.apply_fn(
          {"params": params, "batch_stats": state.batch_stats}, x, train=True, mutable=["batch_stats"]
      )
      return jnp.mean((out - y) ** 2), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return loss, state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])

  for _ in range(2):
    _, state = step(state)
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(directory, state)
  return linen, x, y, state, step


def test_cli_converts_a_linen_orbax_checkpoint_into_one_the_nnx_twin_restores(tmp_path, capsys):
  linen, x, y, state, step = _linen_training_run(tmp_path / "linen")
  destination = tmp_path / "nnx"
  args = [
      "migrate", "convert", str(tmp_path / "linen"), str(destination),
      "--linen", f"{MODELS_FILE}:linen_cnn", "--nnx", f"{MODELS_FILE}:nnx_cnn_with_optimizer",
      "--input-shape", "2,8,8,1", "--linen-arg", "train=false",
  ]  # fmt: skip
  assert cli.main(args) == 0, capsys.readouterr().err
  assert "10 matched" in capsys.readouterr().out
  model, optimizer = mm.nnx_cnn_with_optimizer()
  target = {
      "model": nnx.to_pure_dict(nnx.state(model, nnx.Not(nnx.RngState))),
      "optimizer": nnx.to_pure_dict(nnx.state(optimizer)),
  }
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(destination, target)
  nnx.update(model, restored["model"])
  nnx.update(optimizer, restored["optimizer"])
  assert int(optimizer.step[...]) == int(state.step) == 2
  model.eval()
  expected = linen.apply({"params": state.params, "batch_stats": state.batch_stats}, x, train=False)
  np.testing.assert_allclose(model(x), expected, atol=ATOL)
  model.train()
  linen_loss, _ = step(state)
  np.testing.assert_allclose(_nnx_step(model, optimizer, x, y), linen_loss, rtol=1e-6)
  # Never over an existing checkpoint; the message names it; exit 2.
  assert cli.main(args) == 2
  assert f"{destination} exists" in capsys.readouterr().err


def test_cli_check_prints_the_plan_and_the_verdict(capsys):
  args = ["migrate", "check", "--linen", f"{MODELS_FILE}:linen_cnn", "--nnx", f"{MODELS_FILE}:nnx_cnn_with_optimizer"]
  assert cli.main([*args, "--input-shape", "2,8,8,1", "--linen-arg", "train=false"]) == 0
  out = capsys.readouterr().out
  assert "params/Conv_0/kernel -> conv/kernel" in out and "Linen and NNX agree" in out
  assert cli.main([*args, "--input-shape", "2,x"]) == 2
  assert "--input-shape '2,x'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "shape, which", [("2,8,8,3", "its NNX twin"), ("2,8", "the Linen model")], ids=["channels", "rank"]
)
def test_an_input_shape_a_model_cannot_take_is_named_as_such(tmp_path, capsys, shape, which):
  """Three channels: the Linen CNN initialises for them and only its twin refuses; two dimensions, neither can run.
  Either is named before any weights are matched (it was a plan of unmatched leaves, or a broadcasting error)."""
  models = ["--linen", f"{MODELS_FILE}:linen_cnn", "--nnx", f"{MODELS_FILE}:nnx_cnn_with_optimizer"]
  for args in (["check"], ["convert", str(tmp_path / "linen"), str(tmp_path / "nnx")]):
    if args[0] == "convert" and not (tmp_path / "linen").exists():
      _linen_training_run(tmp_path / "linen")
    assert cli.main(["migrate", *args, *models, "--input-shape", shape, "--linen-arg", "train=false"]) == 2
    assert f"--input-shape {shape} does not fit {which}" in capsys.readouterr().err
  assert not (tmp_path / "nnx").exists()
