"""`maxbridge serve` under load: N concurrent streaming clients over loopback (N = 1, 4, 16 by default).

    .venv/bin/python benchmarks/serve.py [--preset llama-small] [--slots 8] [--clients 1 4 16]
                                         [--requests 32] [--prompt 64] [--new 64] [overrides ...]

Starts the real server (a subprocess, random weights of the preset, byte
tokens) on a free loopback port, warms it up, then for each N runs `--requests`
greedy streamed completions from N client threads at once (each thread sends
its next request when the last one ends) with the official `openai` client.
Prints, per N: throughput (generated tokens / wall time), time to first token
(p50, p95: from sending the request to its first streamed chunk) and per-token
latency (p50, p95 of the gaps between a stream's chunks).
"""

import argparse
import concurrent.futures
import socket
import statistics
import subprocess
import sys
import time
import urllib.request

import numpy as np
import openai


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def start(args) -> tuple[subprocess.Popen, str]:
  port = free_port()
  overrides = [
      f"per_device_batch_size={args.slots}",
      f"max_prefill_predict_length={args.prompt}",
      f"max_target_length={args.prompt + args.new}",
      *args.overrides,
  ]
  argv = [sys.executable, "-m", "maxbridge.cli", "serve", args.preset, "--port", str(port), *overrides]
  argv += ["--max-queue", "1024"]
  server = subprocess.Popen(argv)
  url = f"http://127.0.0.1:{port}"
  deadline = time.monotonic() + 300
  while time.monotonic() < deadline:
    try:
      with urllib.request.urlopen(url + "/health", timeout=5):
        return server, url
    except OSError:
      if server.poll() is not None:
        raise SystemExit(f"the server exited with {server.returncode}") from None
      time.sleep(0.5)
  server.kill()
  raise SystemExit("the server did not come up in 300 s")


def one(client: openai.OpenAI, model: str, prompt: str, new: int) -> tuple[float, list[float], int]:
  """(seconds to the first token, the gaps between later tokens, tokens) of one streamed greedy completion."""
  start = time.perf_counter()
  stamps = []
  for chunk in client.completions.create(model=model, prompt=prompt, max_tokens=new, temperature=0, stream=True):
    if chunk.choices[0].finish_reason is None:
      stamps.append(time.perf_counter())
  return stamps[0] - start, list(np.diff(stamps)), len(stamps)


def run(url: str, clients: int, requests: int, args) -> dict:
  client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=600)
  model = client.models.list().data[0].id  # the server refuses another model's name
  rng = np.random.default_rng(clients)
  prompts = ["".join(chr(c) for c in rng.integers(97, 123, args.prompt)) for _ in range(requests)]
  start = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(clients) as pool:
    results = list(pool.map(lambda p: one(client, model, p, args.new), prompts))
  wall = time.perf_counter() - start
  ttft = [r[0] for r in results]
  gaps = [g for r in results for g in r[1]]
  tokens = sum(r[2] for r in results)
  return dict(
      throughput=tokens / wall,
      ttft50=statistics.median(ttft),
      ttft95=float(np.percentile(ttft, 95)),
      tok50=statistics.median(gaps),
      tok95=float(np.percentile(gaps, 95)),
  )


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="llama-small")
  parser.add_argument("--slots", type=int, default=8, help="decode slots (per_device_batch_size)")
  parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
  parser.add_argument("--requests", type=int, default=32, help="requests per client count")
  parser.add_argument("--prompt", type=int, default=64, help="prompt tokens (bytes)")
  parser.add_argument("--new", type=int, default=64, help="tokens per completion")
  parser.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides for the server")
  args = parser.parse_args()
  server, url = start(args)
  try:
    for clients in args.clients:  # compiles the prefills and inserts of the batch sizes each row makes
      run(url, clients, clients, args)
    print(
        f"maxbridge serve {args.preset}, {args.slots} slots, prompt {args.prompt}, {args.new} new tokens, "
        f"{args.requests} streamed greedy requests per row"
    )
    print(f"{'clients':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'tok p50':>8} {'tok p95':>8}  (seconds)")
    for clients in args.clients:
      r = run(url, clients, args.requests, args)
      print(
          f"{clients:>7} {r['throughput']:8.1f} {r['ttft50']:9.3f} {r['ttft95']:9.3f} {r['tok50']:8.4f} "
          f"{r['tok95']:8.4f}"
      )
  finally:
    server.terminate()
    server.wait(timeout=60)


if __name__ == "__main__":
  main()
