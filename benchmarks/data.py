"""The Grain input pipeline (`dataset_type: grain`) against what a train step eats, its memory, and its start.

    .venv/bin/python benchmarks/data.py [--gib 2] [--seconds 20] [--folder /tmp]

In one run, on JSONL corpora of random words generated under `--folder` (removed at the end):
  1. input throughput, real tokens/s, with grain_worker_count 0, 1 and 2, byte tokens and a small BPE
     tokenizer, each in a fresh process, against llama-small's train step consumption (tokens/s of one
     step of per_device_batch_size rows of max_target_length, median of a few, on this machine);
  2. peak RSS of a process streaming `--seconds` of batches (globally shuffled: reads land all over the
     file) from a corpus of `--gib` / 4 GiB and one of `--gib` GiB, against the bound chosen here
     (`RSS_BOUND`): flat in the corpus size is the goal, and the bigger corpus is 4x the bound;
  3. time to the first batch on the `--gib` GiB corpus, JSONL (which is indexed first: one pass over the
     file) and ArrayRecord (converted with `maxbridge data convert`, conversion time printed too).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RSS_BOUND = 512 << 20  # bytes: the most a process reading any corpus should hold
PRESET = "llama-small"
WORDS = np.array("the of and a to in is was he for it with as his on be at by had are but from or have an".split())


def write_corpus(path: Path, size: int, seed: int = 0) -> None:
  """JSONL of random-word documents (50-2000 words), about `size` bytes: a 32 MiB block written over and over
  (the reader does not care that documents repeat; generating 2 GiB of distinct ones would take minutes)."""
  rng = np.random.default_rng(seed)
  lines, block = [], 0
  while block < min(size, 32 << 20):
    words = WORDS[rng.integers(0, WORDS.size, rng.integers(50, 2000))]
    lines.append(json.dumps({"text": " ".join(words)}) + "\n")
    block += len(lines[-1])
  chunk = "".join(lines).encode()
  with path.open("wb") as f:
    for _ in range(max(1, round(size / len(chunk)))):
      f.write(chunk)


def train_bpe(folder: Path, corpus: Path) -> None:
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers

  tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
  tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
  with corpus.open() as f:
    sample = [json.loads(next(f))["text"] for _ in range(200)]
  tokenizer.train_from_iterator(
      sample, trainers.BpeTrainer(vocab_size=250, special_tokens=["<s>", "</s>", "<unk>"], show_progress=False)
  )
  folder.mkdir()
  tokenizer.save(str(folder / "tokenizer.json"))
  (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


# Runs in a fresh process: its peak RSS and its start are its own.
CHILD = """
import json, sys, time
began = time.perf_counter()
from maxbridge.core.config import load_config
from maxbridge.training import grain_data
args = json.loads(sys.argv[1])
config = load_config(args["preset"], dataset_type="grain", **args["overrides"])
made = time.perf_counter()
dataset = grain_data.GrainDataset(config, "train", config.per_device_batch_size)
first = dataset.batch(0)
ready = time.perf_counter()
tokens, steps = int((first["inputs_segmentation"] > 0).sum()), 1
while time.perf_counter() - ready < args["seconds"]:
  tokens += int((dataset.batch(steps)["inputs_segmentation"] > 0).sum())
  steps += 1
seconds = time.perf_counter() - ready
dataset.close()
# VmHWM, not getrusage: ru_maxrss of a child started by a big parent can start at the parent's size.
rss = int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1])
print(json.dumps({"first_batch_s": ready - made, "tokens_per_s": tokens / seconds, "steps": steps,
                  "peak_rss_mib": rss / 1024}))
"""


def child(seconds: float, **overrides) -> dict:
  env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  argument = json.dumps({"preset": PRESET, "seconds": seconds, "overrides": overrides})
  proc = subprocess.run([sys.executable, "-c", CHILD, argument], env=env, capture_output=True, text=True)
  if proc.returncode:
    raise RuntimeError(proc.stderr[-3000:])
  return json.loads(proc.stdout.strip().splitlines()[-1])


def step_consumption() -> float:
  """Tokens/s llama-small's train step consumes here (per_device_batch_size x max_target_length per step)."""
  import jax

  from maxbridge.core.config import load_config
  from maxbridge.training import data, recipe

  config = load_config(PRESET)
  trainer = recipe.create_trainer(config)
  state = trainer.init_state(0)
  batch = trainer.shard_batch(data.make_dataset(config, "train", config.per_device_batch_size).batch(0))
  times = []
  for _ in range(6):
    start = time.perf_counter()
    state, metrics = trainer.train_step(state, batch)
    jax.block_until_ready(metrics)
    times.append(time.perf_counter() - start)
  return config.per_device_batch_size * config.max_target_length / statistics.median(times[1:])


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--gib", type=float, default=2.0, help="size of the big corpus in GiB (default 2)")
  parser.add_argument("--seconds", type=float, default=15.0, help="seconds each reader streams (default 15)")
  parser.add_argument("--folder", default=tempfile.gettempdir(), help="where the corpora are written")
  args = parser.parse_args()
  work = Path(tempfile.mkdtemp(prefix="maxbridge-data-bench-", dir=args.folder))
  try:
    big, small = work / "big.jsonl", work / "small.jsonl"
    started = time.perf_counter()
    write_corpus(big, int(args.gib * (1 << 30)))
    write_corpus(small, int(args.gib * (1 << 30) / 4), seed=1)
    print(
        f"corpora: {big.stat().st_size / 2**30:.2f} GiB and {small.stat().st_size / 2**30:.2f} GiB of JSONL "
        f"written in {time.perf_counter() - started:.0f} s"
    )
    train_bpe(work / "bpe", small)
    consumed = step_consumption()
    print(f"\n{PRESET} train step consumes {consumed:,.0f} tokens/s here")

    print("\n1. input throughput (real tokens/s; small corpus, global shuffle)")
    print("| tokenizer | workers | tokens/s | x step | first batch s |")
    print("|---|---|---|---|---|")
    for name, tokenizer in (("bytes", ""), ("BPE (tokenizers)", str(work / "bpe"))):
      for workers in (0, 1, 2):
        got = child(args.seconds, grain_train_files=str(small), grain_worker_count=workers, tokenizer_path=tokenizer)
        print(
            f"| {name} | {workers} | {got['tokens_per_s']:,.0f} | {got['tokens_per_s'] / consumed:.0f}x "
            f"| {got['first_batch_s']:.2f} |"
        )

    print(f"\n2. peak RSS streaming {args.seconds:.0f} s of shuffled batches (bound {RSS_BOUND >> 20} MiB)")
    print("| corpus | corpus / bound | peak RSS MiB | batches read |")
    print("|---|---|---|---|")
    for corpus in (small, big):
      got = child(args.seconds, grain_train_files=str(corpus))
      print(
          f"| {corpus.stat().st_size / 2**30:.2f} GiB | {corpus.stat().st_size / RSS_BOUND:.1f}x "
          f"| {got['peak_rss_mib']:.0f} | {got['steps']} |"
      )

    print(f"\n3. time to first batch, {big.stat().st_size / 2**30:.2f} GiB corpus (fresh process; page cache warm)")
    got = child(0, grain_train_files=str(big))
    print(f"JSONL (indexed on open): {got['first_batch_s']:.2f} s")
    started = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    subprocess.run(
        [sys.executable, "-m", "maxbridge.cli", "data", "convert", str(big), str(work / "ar")],
        env=env,
        check=True,
        stdout=subprocess.DEVNULL,
    )
    print(f"(maxbridge data convert to ArrayRecord: {time.perf_counter() - started:.0f} s)")
    got = child(0, grain_train_files=str(work / "ar"))
    print(f"ArrayRecord: {got['first_batch_s']:.2f} s")
  finally:
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
  main()
