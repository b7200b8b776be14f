"""lm-evaluation-harness against `maxbridge serve`, as an evaluator runs it (`--model local-completions`).

The harness scores multiple-choice items by echoing each context + choice with
`logprobs` and summing the choice's token logprobs; it tokenizes on the server
(/tokenize, /detokenize, /tokenizer_info, which it detects) and, by default,
sends token ids. Each score and each greedy continuation it reads through the
server must equal the one computed from the model's logits here, item by item.
The tasks are built in the test as local JSON files: nothing is downloaded.
"""

import json

import jax
import numpy as np
import pytest

from maxbridge.interop import pretrained
from maxbridge.models import dispatch
import served

OVERRIDES = ["per_device_batch_size=4", "max_target_length=64", "max_prefill_predict_length=32"]
ITEMS = 12
NEW_TOKENS = 4
WIDTH = 32  # every direct forward pass is padded to this (causal: nothing reads the padding), so one compile serves


def _docs(seed: int) -> tuple[list[dict], list[dict]]:
  """Multiple-choice items (a 2-6 word context, four choices of 1-3 words, the answer at random) and prompts."""
  rng = np.random.default_rng(seed)
  words = lambda n: " ".join(f"w{t}" for t in rng.integers(1, 256, n))  # noqa: E731
  choice = [
      {"context": words(rng.integers(2, 7)), "choices": [words(rng.integers(1, 4)) for _ in range(4)], "answer": int(a)}
      for a in rng.integers(0, 4, ITEMS)
  ]
  generate = [{"context": words(rng.integers(2, 7))} for _ in range(ITEMS // 2)]
  return choice, generate


TASKS = """
task: mb_choice
dataset_path: json
dataset_kwargs: {{data_files: {{test: {choice}}}}}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{context}}}}"
doc_to_choice: choices
doc_to_target: answer
metric_list: [{{metric: acc}}]
---
task: mb_generate
dataset_path: json
dataset_kwargs: {{data_files: {{test: {generate}}}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{target}}}}"
generation_kwargs: {{until: ["\\n\\n"], max_gen_toks: {new_tokens}}}
metric_list: [{{metric: exact_match}}]
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  """(the server, the task folder, each choice's loglikelihood and each prompt's greedy text, computed directly)."""
  root = tmp_path_factory.mktemp("harness")
  folder = served.write_folder(root)
  config, params = pretrained.load_pretrained(folder, *OVERRIDES, **pretrained.backend_overrides("nnx"))
  model = dispatch.create_model(config, params=params)
  tokenizer = pretrained.load_tokenizer(folder, config.vocab_size)
  encode = lambda text: tokenizer.encode(text).ids  # noqa: E731
  choice, generate = _docs(0)
  rows = 4 * ITEMS  # every forward pass here is [rows, WIDTH]: one compile

  def log_softmax(sequences: list[list[int]]) -> np.ndarray:
    batch = np.zeros((rows, WIDTH), np.int32)
    for i, tokens in enumerate(sequences):
      batch[i, : len(tokens)] = tokens
    return np.asarray(jax.nn.log_softmax(model.logits(batch).astype(np.float32), axis=-1))

  pairs = [(encode(doc["context"]), encode(text)) for doc in choice for text in doc["choices"]]
  lps = log_softmax([context + continuation for context, continuation in pairs])
  scores = [sum(lp[len(c) - 1 + i, t] for i, t in enumerate(x)) for lp, (c, x) in zip(lps, pairs)]
  prompts = [encode(doc["context"]) for doc in generate]
  for _ in range(NEW_TOKENS):
    lps = log_softmax(prompts)
    prompts = [p + [int(lp[len(p) - 1].argmax())] for lp, p in zip(lps, prompts)]
  for doc, tokens in zip(generate, prompts):
    doc["target"] = tokenizer.decode(tokens[-NEW_TOKENS:])
  tasks = root / "tasks"
  tasks.mkdir()
  for name, docs in (("choice", choice), ("generate", generate)):
    (tasks / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
  paths = {name: tasks / f"{name}.jsonl" for name in ("choice", "generate")}
  for i, text in enumerate(TASKS.format(**paths, new_tokens=NEW_TOKENS).split("---")):
    (tasks / f"task{i}.yaml").write_text(text)
  server = served.Server(folder, "nnx", *OVERRIDES)
  with pytest.MonkeyPatch.context() as env:  # nothing downloaded, nothing cached outside this test's folder
    env.setenv("HF_DATASETS_OFFLINE", "1")
    env.setenv("HF_HUB_OFFLINE", "1")
    env.setenv("HF_DATASETS_CACHE", str(root / "datasets"))
    yield server, tasks, np.reshape(scores, (ITEMS, 4)), [d["target"] for d in generate], choice
  server.stop()


def _evaluate(server, tasks, names, **model_args) -> dict:
  # Imported here, under `setup`'s environment: `datasets` reads its offline and cache settings when imported.
  import lm_eval  # noqa: PLC0415
  from lm_eval.tasks import TaskManager  # noqa: PLC0415

  model_args = dict(base_url=server.url + "/v1/completions", model=served.MODEL, max_retries=1, **model_args)
  return lm_eval.simple_evaluate(
      model="local-completions",
      model_args=model_args,
      tasks=names,
      task_manager=TaskManager(include_path=str(tasks), include_defaults=False),  # not its ~10k built-in tasks
      log_samples=True,
  )


@pytest.mark.parametrize("requests", ["token ids", "text"])
def test_harness_scores_through_the_server_equal_the_models_own(setup, requests):
  server, tasks, scores, greedy, choice = setup
  args = dict(tokenized_requests=True, batch_size=4) if requests == "token ids" else dict(tokenized_requests=False)
  out = _evaluate(server, tasks, ["mb_choice", "mb_generate"], **args)
  samples = sorted(out["samples"]["mb_choice"], key=lambda s: s["doc_id"])
  got = np.array([[ll for ll, _ in s["filtered_resps"]] for s in samples])
  np.testing.assert_allclose(got, scores, atol=1e-5)
  np.testing.assert_array_equal(got.argmax(1), scores.argmax(1))
  direct = np.mean(scores.argmax(1) == [d["answer"] for d in choice])
  assert out["results"]["mb_choice"]["acc,none"] == direct
  generated = sorted(out["samples"]["mb_generate"], key=lambda s: s["doc_id"])
  assert [s["filtered_resps"][0] for s in generated] == greedy
  assert out["results"]["mb_generate"]["exact_match,none"] == 1.0
