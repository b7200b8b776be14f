"""Post-training inputs a user writes: rows cut by max_target_length (counted, or refused when a completion is
lost), their own reward function, and their own tokenizer files. Each is named in one line, exit 2 from the CLI,
before anything compiles (but the reward that fails mid-run, which needs a sampled step)."""

import json
import math
import sys

import numpy as np
import pytest

from maxbridge import cli
from maxbridge.interop import pretrained
from maxbridge.training import data
from maxbridge.training.posttrain import dpo, grpo, sft
from conftest import LINEN_ARGS, tiny_config

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")


def _cli(argv, capsys) -> tuple[int, str]:
  code = cli.main([str(a) for a in argv])
  return code, capsys.readouterr().err


def _train_args(tmp_path, *overrides) -> list[str]:
  return ["train", "llama-tiny", f"base_output_directory={tmp_path / 'runs'}", *LINEN_ARGS, *overrides]


def _jsonl(path, rows) -> str:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))
  return str(path)


# --- rows longer than max_target_length -------------------------------------------------------


def _sft_rows(long_prompt: int = 0) -> list[dict]:
  """Six rows of 16 tokens or fewer; row 3 (line 3) has an 8-token prompt and a 20-token completion, and
  with `long_prompt` a row 5 whose prompt alone is that long."""
  rows = [{"prompt": f"Q{i}?", "completion": "yes"} for i in range(6)]
  rows[2] = {"prompt": "p" * 8, "completion": "c" * 20}
  if long_prompt:
    rows[4] = {"prompt": "p" * long_prompt, "completion": "answer"}
  return rows


def test_examples_cut_by_max_target_length_are_counted_in_a_warning_naming_the_file(tmp_path):
  path = _jsonl(tmp_path / "sft.jsonl", _sft_rows())
  config = tiny_config(dataset_type="sft", dataset_path=path, max_target_length=16, sft_train_on_completion_only=True)
  with pytest.warns(UserWarning, match=r"sft\.jsonl: 1 of 6 examples are longer than max_target_length=16 tokens"):
    rows = data.make_dataset(config, "train").rows
  # The cut row keeps its 8-token prompt and the first 8 of its 20 completion tokens, each trained on.
  trained = rows["targets"][rows["targets_segmentation"] > 0]
  assert bytes(trained.astype(np.uint8)).decode().count("c") == 8


# In the built-in template, "<|system|>\n" + "s" * 10 + "<|end|>\n<|user|>\nu<|end|>\n<|assistant|>\n": 61 prompt bytes.
LONG_CHAT = [
    {"role": "system", "content": "s" * 10},
    {"role": "user", "content": "u"},
    {"role": "assistant", "content": "a"},
]


@pytest.mark.parametrize(
    "rows,line,prompt",
    [
        (_sft_rows(long_prompt=16), 5, 16),  # the prompt fills the row: its completion's first token is cut
        (_sft_rows(long_prompt=40), 5, 40),
        ([{"messages": LONG_CHAT}] * 2, 1, 61),
    ],
)
def test_an_sft_row_whose_completion_is_cut_away_is_refused_naming_file_line_and_lengths(tmp_path, rows, line, prompt):
  path = _jsonl(tmp_path / "sft.jsonl", rows)
  config = tiny_config(dataset_type="sft", dataset_path=path, max_target_length=16)
  match = rf"sft\.jsonl:{line}: the prompt is {prompt} tokens, so max_target_length=16 leaves no completion token"
  with pytest.raises(ValueError, match=match):
    data.make_dataset(config, "train")


def test_a_dpo_row_whose_chosen_or_rejected_completion_is_cut_away_is_refused(tmp_path):
  rows = [{"prompt": f"{i}+{i}=", "chosen": f"{2 * i}\n", "rejected": "0\n"} for i in range(4)]
  rows[1] = {"prompt": "q" * 14, "chosen": "ok\n", "rejected": "x" * 10}  # both sides keep 2 tokens: cut, kept
  path = _jsonl(tmp_path / "prefs.jsonl", rows)
  config = tiny_config(use_dpo=True, dataset_path=path, max_target_length=16)
  with pytest.warns(UserWarning, match=r"prefs\.jsonl: 1 of 4 examples are longer than max_target_length=16"):
    data.make_dataset(config, "train")
  # Both sides share the prompt: a prompt that fills the row loses the chosen side first.
  rows[3] = {"prompt": "q" * 16, "chosen": "ok\n", "rejected": "no\n"}
  _jsonl(tmp_path / "prefs.jsonl", rows)
  with pytest.raises(ValueError, match=r"prefs\.jsonl:4 \(chosen\): the prompt is 16 tokens, so max_target_length=16"):
    data.make_dataset(config, "train")
  rows[3] = {"prompt": "q", "chosen": "ok\n", "rejected": ""}
  _jsonl(tmp_path / "prefs.jsonl", rows)
  with pytest.raises(ValueError, match=r"prefs\.jsonl:4 \(rejected\): the completion is empty"):
    data.make_dataset(config, "train")
  with pytest.raises(ValueError, match=r"mine, pair 1 \(chosen\): the prompt is 2 tokens, so max_target_length=2"):
    dpo.fit_pairs([dpo.pair([1], [3], [4, 5]), dpo.pair([1, 2], [3], [4])], 2, "mine")


def test_empty_completions_and_the_built_in_sets_too_short_a_row_are_refused(tmp_path):
  path = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": ""}])
  with pytest.raises(ValueError, match=r"sft\.jsonl:2: the completion is empty, so the row has nothing to train on"):
    data.make_dataset(tiny_config(dataset_type="sft", dataset_path=path))
  # The built-in sets' longest prompts ("19+19=") are 6 tokens: a row of 6 keeps none of their answers.
  with pytest.raises(
      ValueError, match=r"the built-in SFT set, example \d+: the prompt is 6 tokens, so max_target_length=6"
  ):
    data.make_dataset(tiny_config(dataset_type="sft", max_target_length=6))
  with pytest.raises(ValueError, match=r"the built-in preference set, pair \d+ \(chosen\): the prompt is 6 tokens"):
    data.make_dataset(tiny_config(use_dpo=True, max_target_length=6))


def test_the_cli_refuses_a_lost_completion_with_exit_2_and_creates_no_run(tmp_path, capsys):
  sft_path = _jsonl(tmp_path / "sft.jsonl", _sft_rows(long_prompt=40))
  code, err = _cli(_train_args(tmp_path, "dataset_type=sft", f"dataset_path={sft_path}", "max_target_length=32"), capsys)
  assert code == 2 and "sft.jsonl:5: the prompt is 40 tokens, so max_target_length=32" in err, err
  rows = [{"prompt": "p" * 40, "chosen": "a", "rejected": "b"}] * 3
  dpo_path = _jsonl(tmp_path / "prefs.jsonl", rows)
  code, err = _cli(_train_args(tmp_path, "use_dpo=true", f"dataset_path={dpo_path}", "max_target_length=32"), capsys)
  assert code == 2 and "prefs.jsonl:1 (chosen): the prompt is 40 tokens" in err, err
  code, err = _cli(_train_args(tmp_path, "use_grpo=true", "max_prefill_predict_length=4"), capsys)
  assert code == 2 and "the GRPO prompt '10+10=' is 6 tokens, longer than max_prefill_predict_length=4" in err, err
  assert not (tmp_path / "runs").exists()


# --- the user's reward function ---------------------------------------------------------------

REWARDS = r"""
import math

def good(prompt, completion):
  return 1.0

def one_argument(completion):
  return 1.0

def three_arguments(prompt, completion, answer):
  return 1.0

def keyword_only(prompt, *, completion):
  return 1.0

def divides_by_zero(prompt, completion):  # on the third completion only
  return 1 / (completion != "4\n")

def nan(prompt, completion):
  return math.nan

def inf(prompt, completion):
  return -math.inf

def text(prompt, completion):
  return "1.0"

def array(prompt, completion):
  return [1.0]
"""


@pytest.fixture
def rewards(tmp_path, monkeypatch):
  (tmp_path / "user_rewards.py").write_text(REWARDS)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.delitem(sys.modules, "user_rewards", raising=False)  # each test imports its own file
  return "user_rewards"


@pytest.mark.parametrize(
    "name,signature",
    [
        ("one_argument", r"\(completion\)"),
        ("three_arguments", r"\(prompt, completion, answer\)"),
        ("keyword_only", r"\(prompt, \*, completion\)"),
    ],
)
def test_a_reward_function_with_the_wrong_signature_is_refused_at_load(rewards, name, signature):
  match = rf"reward_function '{rewards}\.{name}' is called as reward\(prompt: str, completion: str\), but its signature is {signature}"
  with pytest.raises(ValueError, match=match):
    grpo.load_reward(f"{rewards}.{name}")
  assert grpo.load_reward(f"{rewards}.good")("p", "c") == 1.0


@pytest.mark.parametrize(
    "name,match",
    [
        (
            "divides_by_zero",
            r"raised on prompt 1 \('2\+2='\), completion 0 \('4\\n'\): ZeroDivisionError: division by zero",
        ),
        ("nan", r"returned nan on prompt 0 \('1\+1='\), completion 0 \('2\\n'\): a reward must be finite"),
        ("inf", r"returned -inf on prompt 0 \('1\+1='\), completion 0 \('2\\n'\): a reward must be finite"),
        ("text", r"must return one number per completion .*got '1\.0' on prompt 0"),
        ("array", r"must return one number per completion .*got \[1\.0\] on prompt 0"),
    ],
)
def test_a_reward_that_raises_or_is_not_a_finite_number_names_the_function_and_the_completion(rewards, name, match):
  reward = grpo.load_reward(f"{rewards}.{name}")
  completions = ["2\n", "3\n", "4\n", "5\n"]
  with pytest.raises(ValueError, match=rf"reward_function '{rewards}\.{name}' " + match):
    grpo.score(reward, ["1+1=", "2+2="], completions, 2)
  assert math.isclose(grpo.score(grpo.load_reward(f"{rewards}.good"), ["1+1="], ["2\n", "3\n"], 2).sum(), 2.0)


def test_the_cli_exits_2_naming_reward_function_before_and_during_training(rewards, tmp_path, capsys):
  code, err = _cli(_train_args(tmp_path, "use_grpo=true", f"reward_function={rewards}.one_argument"), capsys)
  assert code == 2 and f"reward_function '{rewards}.one_argument' is called as reward(prompt" in err, err
  code, err = _cli(_train_args(tmp_path, "use_grpo=true", "reward_function=user_rewards_missing.good"), capsys)
  assert code == 2 and "reward_function 'user_rewards_missing.good' cannot be imported" in err, err
  assert not (tmp_path / "runs").exists()
  # A reward that fails on a sampled completion: the smallest GRPO step that samples.
  small = [
      "steps=1",
      "per_device_batch_size=1",
      "num_generations=2",
      "max_target_length=16",
      "max_prefill_predict_length=8",
  ]
  code, err = _cli(_train_args(tmp_path, "use_grpo=true", f"reward_function={rewards}.nan", *small), capsys)
  assert code == 2 and f"reward_function '{rewards}.nan' returned nan on prompt 0" in err, err
  assert "internal error" not in err and not (tmp_path / "runs" / "llama-tiny").exists()


# --- the user's tokenizer files ---------------------------------------------------------------


def _tokenizer_folder(folder, words: int = 64, template: str | None = None):
  """A word-level tokenizer of `words` words (w0, w1, ...; "s" and the chat markers first) in `folder`."""
  folder.mkdir(exist_ok=True)
  names = ["s", "<", ">", "/", "user", "assistant", "system"]
  vocab = {w: i for i, w in enumerate(names + [f"w{i}" for i in range(words - len(names))])}
  tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="s"))
  tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tokenizer.save(str(folder / "tokenizer.json"))
  if template is not None:
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
  return folder


CHAT = "{% for m in messages %}<{{ m.role }}> {{ m.content }} </s> {% endfor %}{% if add_generation_prompt %}<assistant> {% endif %}"
CHATS = [{"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]}] * 3


def test_a_tokenizer_json_that_cannot_be_read_is_named(tmp_path):
  folder = _tokenizer_folder(tmp_path / "tok")
  (folder / "tokenizer.json").write_text("{not json")
  with pytest.raises(
      ValueError,
      match=r"tokenizer_path='.*tok': .*tok/tokenizer\.json is not a tokenizer the tokenizers package can read: key must be a string",
  ):
    sft.HFChat(str(folder))
  (folder / "tokenizer.json").write_text(json.dumps({"version": "1.0"}))  # JSON, but not a tokenizer
  with pytest.raises(ValueError, match=r"tok/tokenizer\.json is not a tokenizer the tokenizers package can read"):
    pretrained.load_tokenizer(folder)
  (folder / "tokenizer.json").unlink()
  with pytest.raises(FileNotFoundError, match=r"tok/tokenizer\.json does not exist"):
    sft.HFChat(str(folder))
  _tokenizer_folder(folder)
  (folder / "tokenizer_config.json").write_text("{'chat_template': ''}")
  with pytest.raises(ValueError, match=r"tok/tokenizer_config\.json is not JSON"):
    sft.HFChat(str(folder))


@pytest.mark.parametrize(
    "template,match",
    [
        ("{% for m in messages %}{{ m.content }", r"chat_template is not a valid Jinja template: line 1: unexpected '}'"),
        (
            "{% if messages %}{{ messages[0].content }}",
            r"chat_template is not a valid Jinja template: line 1: Unexpected end of template",
        ),
        (
            "{{ raise_exception('Conversation roles must alternate user/assistant') }}",
            r"sft\.jsonl:1: .*chat_template fails on this row's messages: TemplateError: Conversation roles must alternate",
        ),
        (
            "{{ messages[0].content.upper(1, 2) }}",
            r"sft\.jsonl:1: .*chat_template fails on this row's messages: TypeError",
        ),
    ],
)
def test_a_chat_template_that_does_not_compile_or_raises_on_the_messages_is_named(tmp_path, template, match):
  folder = _tokenizer_folder(tmp_path / "tok", template=template)
  config = tiny_config(dataset_type="sft", dataset_path=_jsonl(tmp_path / "sft.jsonl", CHATS), tokenizer_path=str(folder))
  with pytest.raises(ValueError, match=match):
    data.make_dataset(config)


def test_a_chat_template_jinja_file_wins_over_the_config_key_as_in_transformers(tmp_path):
  folder = _tokenizer_folder(tmp_path / "tok", template="{{ raise_exception('not this one') }}")
  (folder / "chat_template.jinja").write_text(CHAT)
  chat = sft.HFChat(str(folder))
  tokens, completion = chat.render_chat(CHATS[0]["messages"])
  np.testing.assert_array_equal(tokens, chat.encode("<user> w1 w2 </s> <assistant> w3 </s>"))
  np.testing.assert_array_equal(tokens[completion], chat.encode("w3 </s>"))
  (folder / "chat_template.jinja").unlink()
  (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": CHAT}]}))
  with pytest.raises(
      ValueError, match=r"chat_template is a list of named templates with none named 'default' \(names: \['tool_use'\]\)"
  ):
    sft.HFChat(str(folder))


def test_a_tokenizer_with_ids_past_vocab_size_is_refused_naming_both_numbers(tmp_path, capsys):
  folder = _tokenizer_folder(tmp_path / "tok", words=300, template=CHAT)
  with pytest.raises(ValueError, match=r"tokenizer\.json makes token ids up to 299, but the model's vocab_size=256"):
    pretrained.load_tokenizer(folder, 256)
  assert pretrained.load_tokenizer(folder, 300).get_vocab_size() == 300
  sft_path = _jsonl(tmp_path / "sft.jsonl", CHATS)
  code, err = _cli(
      _train_args(tmp_path, "dataset_type=sft", f"dataset_path={sft_path}", f"tokenizer_path={folder}"), capsys
  )
  assert (
      code == 2 and "makes token ids up to 299, but the model's vocab_size=256 has embeddings for ids 0..255" in err
  ), err
  prefs = _jsonl(tmp_path / "prefs.jsonl", [{"prompt": "w1", "chosen": "w2", "rejected": "w3"}] * 3)
  code, err = _cli(_train_args(tmp_path, "use_dpo=true", f"dataset_path={prefs}", f"tokenizer_path={folder}"), capsys)
  assert code == 2 and "makes token ids up to 299" in err, err
  (folder / "tokenizer.json").write_text("[1, 2")
  code, err = _cli(
      _train_args(tmp_path, "dataset_type=sft", f"dataset_path={sft_path}", f"tokenizer_path={folder}"), capsys
  )
  assert code == 2 and "tokenizer.json is not a tokenizer the tokenizers package can read" in err, err
  assert not (tmp_path / "runs").exists()
