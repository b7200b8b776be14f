"""Shared fixtures. Models are tiny (llama-tiny) so the whole matrix stays fast."""

import ctypes
import gc
import itertools
import os
import re
import shutil
import tempfile

# The suite is almost all compilation of tiny programs, and LLVM at -O0 compiles them in about two thirds of the
# time. XLA's own passes (fusion, SPMD partitioning) run as always, and the suite's tolerances hold at -O0 as at
# -O3 (the one exact comparison that does not, the pipeline schedule's, compiles at -O3). Set before JAX's CPU
# client starts, here and in each xdist worker (each imports this file first). A run that names a level keeps it:
# `make test-newest` runs XLA's default (-O3), as users do. MAXBRIDGE_FAST_COMPILE=1 (`make test`'s first pass)
# adds XLA CPU's elemental emitters, which halve compile time again, to all but the tests marked
# `fusion_emitters` (its second pass runs those at -O0 alone; see fast_compile.py). The multi-device scripts set
# their own flags.
from fast_compile import ELEMENTAL, FAST_COMPILE, LLVM_O0  # constants; imports no JAX

if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
  flags = FAST_COMPILE if os.environ.get("MAXBRIDGE_FAST_COMPILE") == "1" else LLVM_O0
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()

# The suite runs on the CPU. Only the CPU client starts, here and in every subprocess (they inherit this), so
# libtpu, a test dependency for compiling to TPU slices, loads only in the tests that do so: loaded into every
# process, it installed its own fatal-signal handler in each, and one 8-device subprocess died under it in CI
# (SIGABRT, its cause not in what CI kept). A run that names its platforms keeps them.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (after XLA_FLAGS)
import numpy as np  # noqa: E402
import pytest

import maxbridge as mb

# (pure_nnx, enable_nnx, pure_nnx_decoder): every combination is valid.
FLAG_COMBINATIONS = list(itertools.product([False, True], repeat=3))
# base.yml's default is NNX (as MaxText's since its PR 11). A test of a Linen path, or one written when Linen
# was the default, says so: with tiny_config's default flags, LINEN_FLAGS, or LINEN_ARGS on a command line.
LINEN = (False, False, False)
LINEN_FLAGS = dict(pure_nnx=False, enable_nnx=False, pure_nnx_decoder=False)
LINEN_ARGS = [f"{flag}=false" for flag in LINEN_FLAGS]


def flag_id(flags) -> str:
  return "-".join(f"{name}={int(v)}" for name, v in zip(("pure_nnx", "enable_nnx", "decoder"), flags))


def tiny_config(flags=LINEN, **overrides) -> mb.Config:
  pure_nnx, enable_nnx, pure_nnx_decoder = flags
  return mb.load_config(
      "llama-tiny",
      pure_nnx=pure_nnx,
      enable_nnx=enable_nnx,
      pure_nnx_decoder=pure_nnx_decoder,
      **overrides,
  )


def assert_flash_gives_dot_products_logits(calls: list, kernel: str) -> None:
  """llama-tiny's logits with attention=flash equal dot_product's to 1e-5 on Linen and on NNX, and Linen's equal
  NNX's to 1e-6; `calls`, a spy's list of the calls to `kernel` (the kernel flash reads on this platform), shows
  that it ran for each backend."""
  tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, 256)
  segment_ids = np.array([[1] * 16, [1] * 7 + [2] * 9], np.int32)
  positions = np.array([list(range(16)), [*range(7), *range(9)]], np.int32)
  logits = {}
  for backend, flags in (("linen", LINEN), ("nnx", (True, True, True))):
    for name in ("dot_product", "flash"):
      model = mb.create_model(tiny_config(flags, attention=name), seed=0)
      logits[backend, name] = np.asarray(model.logits(tokens, positions, segment_ids))
    assert calls, f"{backend}: attention=flash never called {kernel}"
    calls.clear()
    np.testing.assert_allclose(
        logits[backend, "flash"], logits[backend, "dot_product"], rtol=1e-5, atol=1e-5, err_msg=f"{backend}: {kernel}"
    )
  np.testing.assert_allclose(
      logits["linen", "flash"], logits["nnx", "flash"], rtol=1e-6, atol=1e-6, err_msg=f"{kernel}: Linen vs NNX"
  )


def failure(stderr: str) -> str:
  """What to show when a subprocess fails: its fatal lines (a crash's first line is often far above its tail of
  stack frames and signal-handler chatter), then the tail."""
  fatal = [
      line
      for line in stderr.splitlines()
      if re.match(r"(F\d{4} |Fatal Python error|.*Check failed|.*Termination timeout)", line)
  ]
  return "\n".join(fatal[:20]) + "\n...\n" + stderr[-3000:]


def pytest_configure(config):
  """One JAX persistent compilation cache for the whole run: its xdist workers and subprocesses.

  Linen, NNX and the bridged mixes of one model lower to the same HLO (that is
  what parity means), and many files build the same tiny models, so most
  compilations of a run are repeats. The cache is new for each run, so a run
  never depends on what an earlier one compiled.
  """
  if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # not inherited: this process owns the run
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="maxbridge-jax-cache-")
    config.add_cleanup(lambda: shutil.rmtree(os.environ.pop("JAX_COMPILATION_CACHE_DIR"), ignore_errors=True))
  # Tiny models compile in well under JAX's default one-second threshold; cache them all.
  os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
  # This process imported JAX before this hook ran (environment variables are read at import).
  jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)


@pytest.fixture(scope="session")
def tokens():
  return jax.random.randint(jax.random.key(1), (2, 16), 0, 256)


try:
  _LIBC = ctypes.CDLL("libc.so.6")  # glibc (Linux); elsewhere nothing is trimmed
except OSError:
  _LIBC = None


@pytest.fixture(autouse=True)
def _fusion_emitters(request):
  """A test marked `fusion_emitters` fails at once, saying why, where its process compiles with elemental ones."""
  if request.node.get_closest_marker("fusion_emitters") and ELEMENTAL in os.environ.get("XLA_FLAGS", ""):
    pytest.fail(
        f"marked fusion_emitters: its exact comparison needs XLA CPU's default emitters, but XLA_FLAGS has "
        f"{ELEMENTAL} (run it without MAXBRIDGE_FAST_COMPILE=1, as `make test`'s second pass does)"
    )


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_functions(request):
  """Each test file's compiled functions are freed when the file ends.

  An xdist worker runs many files in one process, and JAX keeps every executable
  it has compiled, as do a file's own `functools` caches of built models and
  engines. With those cleared a worker still grew to 5.6 GiB over the suite:
  glibc keeps freed memory in its heap unless asked to return it. Trimming after
  each file held a worker running four files at 0.6 GiB, not 1.1. The persistent
  compilation cache above keeps what a later file compiles again cheap.
  """
  yield
  for value in vars(request.module).values():
    if callable(getattr(value, "cache_clear", None)):
      value.cache_clear()
  jax.clear_caches()
  gc.collect()
  if _LIBC is not None:
    _LIBC.malloc_trim(0)
