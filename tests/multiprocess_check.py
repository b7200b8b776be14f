"""One process of a multi-process training run on localhost (started by tests/test_sharding.py).

python multiprocess_check.py OUTPUT_DIR RUN_NAME NUM_PROCESSES PROCESS_ID PORT DEVICES_PER_PROCESS [KEY=VALUE ...]

Config overrides (KEY=VALUE) replace the defaults below (tests/test_scaleout.py: a dcn mesh); the run's mesh
shape is then printed as JSON.
"""

import os
import sys

output, run_name, num_processes, process_id, port, devices = sys.argv[1:7]
from fast_compile import xla_flags  # noqa: E402  (a constant; imports no JAX)

os.environ["XLA_FLAGS"] = xla_flags(int(devices))

import maxbridge as mb  # noqa: E402  (after XLA_FLAGS)

config = mb.load_config(
    "llama-tiny",
    base_output_directory=output,
    run_name=run_name,
    steps=2,
    per_device_batch_size=2,
    eval_interval=0,
    checkpoint_period=2,
    num_processes=int(num_processes),
    process_id=int(process_id),
    coordinator_address=f"localhost:{port}" if int(num_processes) > 1 else "",
    pure_nnx=False,  # Linen, as when it was the default
    enable_nnx=False,
    pure_nnx_decoder=False,
)
overrides = dict(arg.split("=", 1) for arg in sys.argv[7:])
config = config.replace(**overrides) if overrides else config
mb.train(config, progress=False)
if overrides:
  import json  # noqa: E402

  from maxbridge.core import sharding  # noqa: E402

  print(json.dumps(dict(sharding.create_mesh(config).shape)))
