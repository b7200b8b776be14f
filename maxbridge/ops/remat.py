"""The one table from `remat_policy` names to jax checkpoint policies."""

import jax

# name -> policy passed to jax.checkpoint / nn.remat; "none" means no remat.
# "full" saves nothing and recomputes the layer; "minimal" keeps the results
# of weight matmuls, which is MaxText's "minimal".
POLICIES = {
    "full": None,
    "minimal": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
    # MaxText's "minimal_offloaded": what "minimal" saves, held in host memory until the backward pass reads it.
    "minimal_offloaded": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}


def checkpoint_policy(name: str):
  if name not in POLICIES:
    raise ValueError(f"remat_policy {name!r} has no checkpoint policy; valid: {sorted(POLICIES)}")
  return POLICIES[name]
