"""XLA flags for the multi-device subprocess scripts (`multidevice_checks.py`, `multiprocess_check.py`).

Compiled for speed of compiling: those scripts are almost all compilation (~110 tiny
programs, 0.1 s of running each). LLVM's -O0 and XLA CPU's older elemental emitters
cut that to a third. Every check there compares runs compiled alike (sharded vs one
device, NNX vs Linen, one process vs two); the float results move by ~1e-7 relative
against the default flags, well inside the 1e-4 to 1e-6 tolerances. XLA's own passes
(SPMD partitioning, fusion) run as always. The in-process suite takes -O0 alone
(conftest): with the older emitters too, int8 rounding amplified such differences
past a tolerance in six of its tests (a Linen run resumed in NNX, distillation).
"""

LLVM_O0 = "--xla_backend_optimization_level=0"  # the in-process suite's one flag (conftest)
FAST_COMPILE = f"{LLVM_O0} --xla_cpu_use_fusion_emitters=false"


def xla_flags(devices: int) -> str:
  return f"--xla_force_host_platform_device_count={devices} {FAST_COMPILE}"
