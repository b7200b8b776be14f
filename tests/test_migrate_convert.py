"""`maxbridge migrate convert` compares before it writes; reports, rules files and paths a user gets right or is told."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import linen as nn
from flax import nnx

import migrate_models as mm
from maxbridge import cli, migrate

MODELS_FILE = os.path.join(os.path.dirname(__file__), "migrate_models.py")
PAIR_DENSE_BY_RULES = "".join(
    f"  - {{linen: 'params/Dense_{i}/(.*)', nnx: '{name}/\\1'}}\n" for i, name in enumerate(["fc1", "fc2", "fc3", "out"])
)


@pytest.fixture(scope="module")
def linen_checkpoint(tmp_path_factory):
  """A bare Linen variables dict of mm.LinenNormMLP saved with orbax, and the module's outputs on it."""
  directory = tmp_path_factory.mktemp("migrate_convert")
  x = jax.random.normal(jax.random.key(1), (2, 8))
  variables = mm.linen_norm_mlp().init(jax.random.key(5), x)  # not check's seed: the checkpoint's own weights
  with ocp.StandardCheckpointer() as checkpointer:
    checkpointer.save(directory / "linen", variables)
  return directory, x, mm.linen_norm_mlp().apply(variables, x)


def _convert(source, destination, twin, *extra):
  args = ["migrate", "convert", str(source), str(destination), "--linen", f"{MODELS_FILE}:linen_norm_mlp"]
  return cli.main([*args, "--nnx", f"{MODELS_FILE}:{twin}", *extra])


def _restored_outputs(destination, x):
  model = mm.nnx_norm_mlp()
  with ocp.StandardCheckpointer() as checkpointer:
    restored = checkpointer.restore(os.path.abspath(destination), {"model": nnx.to_pure_dict(nnx.state(model))})
  nnx.update(model, restored["model"])
  return model(x)


@pytest.mark.parametrize(
    "twin, first",
    [
        ("nnx_norm_mlp_swapped", "the input of Linen 'Dense_1' / NNX 'fc2'"),
        ("nnx_norm_mlp_gelu", "the input of Linen 'Dense_1' / NNX 'fc2'"),
        ("nnx_norm_mlp_epsilon", "the output of Linen 'LayerNorm_0' / NNX 'norm'"),
    ],
    ids=["swapped-layers", "other-activation", "other-epsilon"],
)
def test_convert_refuses_a_twin_that_computes_differently_and_writes_nothing(linen_checkpoint, capsys, twin, first):
  directory, _, _ = linen_checkpoint
  destination = directory / f"nnx-{twin}"
  assert _convert(directory / "linen", destination, twin, "--input-shape", "2,8") == 2
  err = capsys.readouterr().err
  assert "does not compute what the Linen model does" in err and "Linen and NNX differ (atol 1e-06)" in err, err
  assert f"first difference: {first}" in err and "--allow-mismatch" in err, err
  # Nothing at the destination, and no staging folder left beside it.
  assert not destination.exists() and not [p for p in directory.iterdir() if destination.name in p.name]


def test_convert_writes_a_differing_twin_only_when_allowed_and_warns(linen_checkpoint, capsys):
  directory, x, linen_y = linen_checkpoint
  destination = directory / "nnx-allowed"
  assert (
      _convert(directory / "linen", destination, "nnx_norm_mlp_swapped", "--input-shape", "2,8", "--allow-mismatch") == 0
  )
  assert "warning: writing despite the difference (--allow-mismatch)" in capsys.readouterr().err
  assert destination.is_dir()
  # No --input-shape: nothing to compare on, so refused unless allowed.
  assert _convert(directory / "linen", directory / "nnx-unshaped", "nnx_norm_mlp") == 2
  assert "give it (e.g. --input-shape" in capsys.readouterr().err and not (directory / "nnx-unshaped").exists()
  assert _convert(directory / "linen", directory / "nnx-unshaped", "nnx_norm_mlp", "--allow-mismatch") == 0
  assert "were not compared" in capsys.readouterr().err
  np.testing.assert_allclose(_restored_outputs(directory / "nnx-unshaped", x), linen_y, atol=1e-6)


def test_convert_takes_relative_paths(linen_checkpoint, capsys, monkeypatch):
  directory, x, linen_y = linen_checkpoint
  monkeypatch.chdir(directory)
  assert _convert("linen", "nnx-relative", "nnx_norm_mlp", "--input-shape", "2,8") == 0, capsys.readouterr().err
  assert "Linen and NNX agree" in capsys.readouterr().out
  np.testing.assert_allclose(_restored_outputs(directory / "nnx-relative", x), linen_y, atol=1e-6)


def test_rules_pair_the_modules_they_map_so_the_report_blames_the_right_call(tmp_path, capsys):
  rules = tmp_path / "rules.yml"
  rules.write_text("rules:\n" + PAIR_DENSE_BY_RULES)
  args = ["migrate", "check", "--linen", f"{MODELS_FILE}:linen_norm_mlp", "--input-shape", "2,8", "--rules", str(rules)]
  assert cli.main([*args, "--nnx", f"{MODELS_FILE}:nnx_norm_mlp_swapped"]) == 1
  out = capsys.readouterr().out
  # Not LayerNorm_0's input: the Dense layers the rules pair are compared, and the swap shows at the second.
  assert "first difference: the input of Linen 'Dense_1' / NNX 'fc2'" in out and "every call before it agrees" in out
  assert "LayerNorm" not in out.split("first difference")[1], out


class _TwoHeadsThenNorm(nn.Module):

  def setup(self):
    self.left = nn.Dense(4)
    self.right = nn.Dense(4)
    self.norm = nn.LayerNorm()

  def __call__(self, x):
    return self.norm(jnp.concatenate([self.left(x), 2.0 * self.right(x)], axis=-1))


class _FusedThenNorm(nnx.Module):

  def __init__(self, rngs):
    self.both = nnx.Linear(8, 8, rngs=rngs)
    self.norm = nnx.LayerNorm(8, rngs=rngs)

  def __call__(self, x):
    y = self.both(x)
    return self.norm(jnp.concatenate([y[..., :4], 3.0 * y[..., 4:]], axis=-1))  # Linen scales by 2


def test_a_report_names_the_calls_before_the_difference_that_could_not_be_compared():
  x = jax.random.normal(jax.random.key(2), (2, 8))
  variables = _TwoHeadsThenNorm().init(jax.random.key(0), x)
  rules = [
      {"linen": ["params/left/kernel", "params/right/kernel"], "nnx": "both/kernel", "concat": -1},
      {"linen": ["params/left/bias", "params/right/bias"], "nnx": "both/bias", "concat": 0},
  ]
  result = migrate.compare(_TwoHeadsThenNorm(), _FusedThenNorm(nnx.Rngs(0)), (x,), variables=variables, rules=rules)
  first = result.first_difference
  assert (first.linen_path, first.where, first.unchecked) == ("norm", "input", [("left",), ("right",)]), str(result)
  text = str(first)
  assert "'left', 'right' ran before it and could not be compared" in text and "every call before it agrees" not in text


@pytest.mark.parametrize(
    "content, fault",
    [
        ("rules: [{linen: a, nnx: b\n", "not valid YAML or JSON"),
        ("- {linen: a, nnx: b}\n", "expected a mapping with a list under 'rules'"),
        ('{"rules": [{"linen": "a", "nnx": "b"}], "rule": []}', "unknown top-level keys ['rule']"),
        ("rules:\n  - {linen: a, nnx: b, transpoze: [1, 0]}\n", "rules[0]: a rule has keys linen, nnx"),
        ("rules:\n  - {linen: 'params/Dense_(0/.*', nnx: fc1}\n", "rules[0]: linen 'params/Dense_(0/.*' is not a valid"),
        ("rules:\n  - {linen: a, nnx: b, transpose: yes}\n", "rules[0]: transpose is a list of integers"),
        ("rules:\n  - just a string\n", "rules[0]: a rule is a mapping such as {linen: REGEX, nnx: PATH}"),
        ("rules:\n  - {linen: 'params/Dense_0/(.*)', nnx: 'fc1/\\3'}\n", "does not fit the regex"),
    ],
    ids=[
        "bad-yaml",
        "a-list",
        "unknown-top-key",
        "unknown-rule-key",
        "bad-regex",
        "bad-transpose",
        "not-a-map",
        "bad-group",
    ],
)
def test_a_malformed_rules_file_is_bad_input_naming_the_file_and_the_fault(tmp_path, capsys, content, fault):
  rules = tmp_path / "rules.yml"
  rules.write_text(content)
  args = ["migrate", "check", "--linen", f"{MODELS_FILE}:linen_norm_mlp", "--nnx", f"{MODELS_FILE}:nnx_norm_mlp"]
  assert cli.main([*args, "--input-shape", "2,8", "--rules", str(rules)]) == 2
  err = capsys.readouterr().err
  assert fault in err and "internal error" not in err, err
  assert f"rules file {rules}: " in err, err
