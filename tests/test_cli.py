import re
import warnings

import pytest

from maxbridge import cli


def test_help_lists_every_verb(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--help"])
  assert exit_info.value.code == 0
  # argparse lists each verb at the start of its own line under COMMAND, its help beside or below it.
  listed = re.findall(r"^    (\S+)", capsys.readouterr().out, flags=re.MULTILINE)
  assert sorted(listed) == sorted(cli.HANDLERS)


def test_train_reports_bad_key(capsys):
  assert cli.main(["train", "llama-tiny", "stepz=5"]) == 2
  assert "did you mean 'steps'" in capsys.readouterr().err


def test_bench_times_each_combination_against_pure_linen(capsys):
  options = ["--steps", "2", "--warmup", "0", "--combos", "minimal", "--scan", "false"]
  assert cli.main(["bench", *options, "llama-tiny", "per_device_batch_size=1", "max_target_length=16"]) == 0
  out = capsys.readouterr().out
  assert "== scan_layers=False: llama-tiny" in out and "batch 1 x length 16 = 16 tokens" in out
  rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.count("/") == 2 and "." in line}
  assert sorted(rows) == ["linen/linen/linen", "linen/linen/nnx", "nnx/nnx/linen", "nnx/nnx/nnx"]
  assert rows["linen/linen/linen"][1] == "1.000"  # pure Linen against itself, round by round


def test_bench_rejects_a_bad_option_value(capsys):
  assert cli.main(["bench", "llama-tiny", "--steps", "0"]) == 2
  assert "steps must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize("asked, warned", [([], False), (["--max-new-tokens", "32"], True)])
def test_generate_by_default_stays_within_the_trained_length(asked, warned):
  # llama-tiny trains on 64 tokens: a 40-token prompt leaves room for 24 by default, not 32.
  argv = ["generate", "llama-tiny", "--prompt", "x" * 40, "--backend", "linen", *asked]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    assert cli.main(argv) == 0
  assert any("exceeds max_target_length=64" in str(w.message) for w in caught) == warned
