import pytest

from maxbridge import cli


def test_help_lists_every_verb(capsys):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(["--help"])
  assert exit_info.value.code == 0
  out = capsys.readouterr().out
  for verb in cli.HANDLERS:
    assert verb in out


def test_train_reports_bad_key(capsys):
  assert cli.main(["train", "llama-tiny", "stepz=5"]) == 2
  assert "did you mean 'steps'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bench", "llama-tiny"]])
def test_unbuilt_verbs_say_so_and_exit_two(argv, capsys):
  assert cli.main(argv) == 2
  assert f"{argv[0]}: arrives in a later issue" in capsys.readouterr().err
