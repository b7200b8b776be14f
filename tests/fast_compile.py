"""XLA flags for the multi-device subprocess scripts (`multidevice_checks.py`, `multiprocess_check.py`).

Compiled for speed of compiling: those scripts are almost all compilation (~110 tiny
programs, 0.1 s of running each). LLVM's -O0 and XLA CPU's older elemental emitters
cut that to a third. Every check there compares runs compiled alike (sharded vs one
device, NNX vs Linen, one process vs two); the float results move by ~1e-7 relative
against the default flags, well inside the 1e-4 to 1e-6 tolerances. XLA's own passes
(SPMD partitioning, fusion) run as always. `make test` compiles the in-process suite
so too, but for the tests marked `fusion_emitters` (its second pass, at -O0 alone):
there int8 rounding over many steps, or a long chain of layers, amplifies such
ulp differences between the Linen and NNX programs past an exact tolerance.
"""

LLVM_O0 = "--xla_backend_optimization_level=0"  # conftest's default for the in-process suite
ELEMENTAL = "--xla_cpu_use_fusion_emitters=false"
FAST_COMPILE = f"{LLVM_O0} {ELEMENTAL}"  # these scripts', and the suite's with MAXBRIDGE_FAST_COMPILE=1 (conftest)


# A collective waits this long for its devices' threads before XLA aborts the process. XLA's 40 s default
# aborted an 8-device pipeline check (SIGABRT, "Termination timeout for `all to all` ... Expected 4 threads")
# when the host's 2 cores were busy with other test processes: 8 device threads then take turns, not hang.
COLLECTIVE_TIMEOUT = "--xla_cpu_collective_call_terminate_timeout_seconds=600"


def xla_flags(devices: int) -> str:
  return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE} {COLLECTIVE_TIMEOUT}"
