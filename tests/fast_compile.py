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


# Each op on its device's own thread. With Eigen's shared pool, the 8-device pipeline check deadlocked in an
# all-to-all whenever other processes kept the 2 cores busy ("Termination timeout ... Expected 4 threads to join
# the rendezvous, but only 3 of them arrived", SIGABRT; reproduced beside two busy loops, and it stayed stuck
# for 600 s after they ended): a device's op waited on pool threads held by devices blocked in the collective.
SINGLE_THREADED_OPS = "--xla_cpu_multi_thread_eigen=false"


def xla_flags(devices: int) -> str:
  return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE} {SINGLE_THREADED_OPS}"
