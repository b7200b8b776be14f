"""One process of a two-process Grain run on localhost (started by tests/test_grain_data.py).

python grain_multiprocess_check.py OUTPUT_DIR PROCESS_ID PORT CORPUS

Trains 6 steps uninterrupted ("reference"), then 2 steps of another run, stopped, and resumes it from its
checkpoint (the data iterator's state of each process, saved with the step); prints both runs' losses (process 0's
record of the global step) and the states it restored, as JSON. One trainer compiles once for all three calls.
"""

import json
import os
import sys

output, process_id, port, corpus = sys.argv[1:5]
from fast_compile import xla_flags  # noqa: E402  (a constant; imports no JAX)

os.environ["XLA_FLAGS"] = xla_flags(1)

from maxbridge.core import sharding  # noqa: E402  (after XLA_FLAGS)
from maxbridge.core.config import load_config  # noqa: E402
from maxbridge.training import grain_data, loop, recipe  # noqa: E402

# Counted: a dataset without a saved state would replay to the step and read the same batches, so the losses
# alone cannot tell that each process restored its own state.
restored = []
set_state = grain_data.GrainDataset.set_state


def counted_set_state(self, state):
  restored.append(json.loads(state) if isinstance(state, bytes) else state)
  return set_state(self, state)


grain_data.GrainDataset.set_state = counted_set_state

if __name__ == "__main__":
  config = load_config(
      "llama-tiny",
      base_output_directory=output,
      dataset_type="grain",
      grain_train_files=corpus,
      max_target_length=32,
      per_device_batch_size=2,
      steps=6,
      checkpoint_period=2,
      eval_interval=0,
      num_processes=2,
      process_id=int(process_id),
      coordinator_address=f"localhost:{port}",
  )
  sharding.initialize_distributed(config)  # before the trainer touches a device (train() would, later)
  trainer = recipe.create_trainer(config)
  reference = loop.train(config.replace(run_name="reference"), trainer=trainer, progress=False)
  loop.train(config.replace(run_name="resumed"), trainer=trainer, until_step=2, progress=False)
  resumed = loop.train(config.replace(run_name="resumed"), trainer=trainer, progress=False)
  losses = {"reference": [r["loss"] for r in reference], "resumed": [r["loss"] for r in resumed]}
  print(json.dumps({**losses, "restored": [(s["step"], s["settings"]["process_count"]) for s in restored]}))
