"""Do a Linen model and its NNX twin agree, and if not, in which submodule do they first part?

Both run on the same inputs with the same (converted) weights; outputs and gradients are compared. On a
mismatch, the inputs and outputs of every submodule call are recorded on both sides, in call order:
Linen through `nn.intercept_methods` (Flax's hook on every module method; `capture_intermediates` records
outputs only, and a wrong activation between two layers shows first in the next layer's input), NNX by
giving each submodule, for the run, a subclass whose `__call__` records (NNX has no hook of its own and
`sow` would mean editing the user's model). The first call whose input or output differs names the
culprit: an output that differs from equal inputs is the submodule itself; an input that differs after
every earlier call agreed is the parent's code between its submodules. Only calls of modules the plan pairs
(by structure, or by one-to-one rules) are compared; calls before the culprit that could not be are named in
the report, which then does not claim that everything before it agrees. Calls inside transforms (`nn.scan`,
`nnx.vmap`, `nnx.RNN`) see tracers and are not recorded; the transform's own module is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import traverse_util
from flax import nnx

from maxbridge.migrate.convert import convert, nnx_to_linen_values
from maxbridge.migrate.leaves import path_str
from maxbridge.migrate.match import Plan, match


@dataclasses.dataclass
class Difference:
  linen_path: str
  nnx_path: str
  where: str  # "output": the submodule itself; "input": its parent's code before it; "stack": a layer of a stack
  max_abs: float
  detail: str = ""
  # Linen calls that ran before this one and were not compared: no NNX module is paired with theirs (a
  # split/concat rule, no leaves to match by); the difference may have started in them.
  unchecked: list[tuple] = dataclasses.field(default_factory=list)

  def __str__(self) -> str:
    names = f"Linen '{self.linen_path or '(top)'}' / NNX '{self.nnx_path or '(top)'}'"
    if self.where == "stack":
      return (
          f"first difference: in the stack {names} (max |diff| {self.max_abs:.3g} where its result is next used"
          f"{self.detail}); Linen's nn.scan does not show its layers' calls, so the difference is inside a layer"
      )
    if self.where == "output":
      return (
          f"first difference: the output of {names} (max |diff| {self.max_abs:.3g}{self.detail}); "
          "its inputs agree, so this submodule computes differently"
      )
    if self.unchecked:
      shown = ", ".join(f"'{path_str(p) or '(top)'}'" for p in self.unchecked[:6])
      more = f" and {len(self.unchecked) - 6} more" if len(self.unchecked) > 6 else ""
      return (
          f"first difference among the compared calls: the input of {names} (max |diff| {self.max_abs:.3g}{self.detail}); every "
          f"compared call before it agrees, but Linen's {shown}{more} ran before it and could not be compared (no "
          "NNX submodule is paired with it: pair it with a one-to-one rule linen: 'params/<its path>/(.*)', nnx: "
          "'<NNX path>/\\1'), so the difference may start there or in the parent's code between its submodules"
      )
    return (
        f"first difference: the input of {names} (max |diff| {self.max_abs:.3g}{self.detail}), while every call "
        "before it agrees: the parent's code between its submodules differs (an activation, a residual, an order)"
    )


@dataclasses.dataclass
class Comparison:
  output_max_abs: float
  grad_max_abs: float
  grad_worst: str | None  # the Linen parameter whose gradient differs most
  atol: float
  first_difference: Difference | None = None

  @property
  def ok(self) -> bool:
    return self.output_max_abs <= self.atol and self.grad_max_abs <= self.atol

  def __str__(self) -> str:
    verdict = "agree" if self.ok else "differ"
    lines = [
        f"Linen and NNX {verdict} (atol {self.atol:g}): outputs max |diff| {self.output_max_abs:.3g}, "
        f"gradients max |diff| {self.grad_max_abs:.3g}" + (f" at {self.grad_worst}" if self.grad_worst else "")
    ]
    if self.first_difference is not None:
      lines.append(str(self.first_difference))
    return "\n".join(lines)


def _arrays(tree) -> list:
  return [x for x in jax.tree.leaves(tree) if isinstance(x, (jax.Array, np.ndarray))]


def _traced(tree) -> bool:
  return any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(tree))


def _max_diff(a, b) -> tuple[float, str]:
  a, b = _arrays(a), _arrays(b)
  if len(a) != len(b):
    return float("inf"), f"; {len(a)} arrays vs {len(b)}"
  worst = 0.0
  for x, y in zip(a, b):
    if x.shape != y.shape:
      return float("inf"), f"; shape {x.shape} vs {y.shape}"
    if x.size:  # numpy: concrete values, and no compile per shape
      worst = max(worst, float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)))))
  return worst, ""


def _default_loss(outputs) -> jax.Array:
  # A mean, not a sum: gradients stay O(1) whatever the batch, so one absolute tolerance fits them and outputs.
  return sum(jnp.mean(jnp.square(x.astype(jnp.float32))) for x in _arrays(outputs))


def _set_mode(model: nnx.Module, train: bool) -> None:
  if train:
    model.train()
    # Dropout masks come from different RNG streams in Linen and NNX: they can never agree, so training mode
    # here means batch statistics (BatchNorm) with dropout off.
    for _, module in nnx.iter_modules(model):
      if isinstance(module, nnx.Dropout):
        module.deterministic = True
  else:
    model.eval()


def _linen_events(linen_module, variables, inputs, kwargs, mutable, rngs) -> list:
  events = []

  def record(next_fun, args, call_kwargs, context):
    if context.method_name != "__call__" or _traced(args):
      return next_fun(*args, **call_kwargs)
    path = tuple(context.module.path)
    events.append(("input", path, args))
    out = next_fun(*args, **call_kwargs)
    if not _traced(out):
      events.append(("output", path, out))
    return out

  with nn.intercept_methods(record):
    linen_module.apply(variables, *inputs, **kwargs, mutable=mutable, rngs=rngs)
  return events


def _nnx_events(model: nnx.Module, inputs, kwargs) -> list:
  events = []
  paths = {id(m): tuple(p) for p, m in nnx.iter_modules(model)}
  swapped = []

  def recording(cls):
    def __call__(self, *args, **call_kwargs):
      if _traced(args):
        return cls.__call__(self, *args, **call_kwargs)
      path = paths[id(self)]
      events.append(("input", path, args))
      out = cls.__call__(self, *args, **call_kwargs)
      if not _traced(out):
        events.append(("output", path, out))
      return out

    return type(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__})

  classes: dict = {}
  try:
    for _, module in nnx.iter_modules(model):
      cls = type(module)
      if cls not in classes:
        classes[cls] = recording(cls)
      object.__setattr__(module, "__class__", classes[cls])
      swapped.append((module, cls))
    model(*inputs, **kwargs)
  finally:
    for module, cls in swapped:
      object.__setattr__(module, "__class__", cls)
  return events


def _bisect(plan: Plan, linen_events: list, nnx_events: list, atol: float) -> Difference | None:
  to_nnx = {("input", lin): nx for lin, nx in plan.modules} | {("output", lin): nx for lin, nx in plan.modules}
  for lin, seq, layers in plan.stacks:  # a Linen stack runs as the NNX list's first layer in, last layer out
    to_nnx[("input", lin)], to_nnx[("output", lin)] = seq + (0,), seq + (layers - 1,)
  nnx_index: dict = {}
  counts: dict = {}
  for i, (kind, path, _) in enumerate(nnx_events):
    n = counts[(kind, path)] = counts.get((kind, path), -1) + 1
    nnx_index[(kind, path, n)] = i
  counts = {}
  last_agreed = -1
  # Linen calls that finished without being compared (no NNX module paired with theirs), until an enclosing
  # call's output agrees: "every call before it agrees" may only be said when this is empty.
  unchecked: dict[tuple, None] = {}
  for kind, path, value in linen_events:
    i = None
    if (kind, path) in to_nnx:
      n = counts[(kind, path)] = counts.get((kind, path), -1) + 1
      i = nnx_index.get((kind, to_nnx[(kind, path)], n))
    if i is None:
      if kind == "output":
        unchecked[path] = None
      continue
    diff, detail = _max_diff(value, nnx_events[i][2])
    if diff <= atol:
      last_agreed = max(last_agreed, i)
      if kind == "output":  # whatever ran inside this call is cleared by its agreeing output
        unchecked = {p: None for p in unchecked if p[: len(path)] != path}
      continue
    if kind == "input":
      # Linen's lifted transforms (nn.scan) hide their calls; NNX's Python loop over a list shows them. A
      # stack's layers that ran between the last agreeing call and this one hold the difference.
      for lin, seq, _ in plan.stacks:
        if any(e[1][: len(seq)] == seq for e in nnx_events[last_agreed + 1 : i]):
          return Difference(path_str(lin), path_str(seq), "stack", diff, detail)
    return Difference(path_str(path), path_str(to_nnx[(kind, path)]), kind, diff, detail, unchecked=list(unchecked))
  return None


def compare(
    linen_module: nn.Module,
    nnx_module: nnx.Module,
    inputs: Sequence[Any],
    *,
    variables: Mapping[str, Any],
    plan: Plan | None = None,
    rules: Sequence[Any] = (),
    train: bool = False,
    linen_kwargs: Mapping[str, Any] | None = None,
    nnx_kwargs: Mapping[str, Any] | None = None,
    rngs: Mapping[str, jax.Array] | None = None,
    loss: Callable[[Any], jax.Array] = _default_loss,
    atol: float = 1e-6,
) -> Comparison:
  """Runs `linen_module` on `variables` and `nnx_module` on them converted by `plan`; compares outputs and the
  gradients of `loss(outputs)` with respect to the parameters; on a mismatch, names the first submodule where
  the two part.

  `train`: False runs NNX in `.eval()` mode (dropout off, BatchNorm on running averages), True in `.train()`
  mode with dropout off and Linen with its non-param collections mutable. The Linen module's own mode
  arguments (`train=`, `deterministic=`) go in `linen_kwargs`. `nnx_module` itself is not changed.
  """
  inputs = tuple(inputs)
  linen_kwargs = dict(linen_kwargs or {})
  nnx_kwargs = dict(nnx_kwargs or {})
  variables = nn.unbox(dict(variables))
  plan = plan if plan is not None else match(variables, nnx_module, rules)
  model = nnx.clone(nnx_module)
  nnx.update(model, convert(plan, linen_variables=variables).state)
  _set_mode(model, train)
  mutable = [c for c in variables if c != "params"] if train else False

  def linen_out(params):
    out = linen_module.apply({**variables, "params": params}, *inputs, **linen_kwargs, mutable=mutable, rngs=rngs)
    return out[0] if mutable else out

  def with_output(run):
    def loss_and_output(*args):
      out = run(*args)
      return loss(out), out

    return loss_and_output

  # Compiled: one trace each instead of op-by-op dispatch; the bisect below runs eagerly, as it must to see values.
  (_, lin_y), lin_grads = jax.jit(jax.value_and_grad(with_output(linen_out), has_aux=True))(variables["params"])

  @nnx.jit
  def nnx_run(m, args):
    return nnx.value_and_grad(with_output(lambda m: m(*args, **nnx_kwargs)), has_aux=True)(m)

  (_, nnx_y), nnx_grads = nnx_run(nnx.clone(model), inputs)
  flat_nnx = {tuple(p): v.get_value() for p, v in nnx.to_flat_state(nnx_grads)}
  mapped = nnx_to_linen_values(plan, flat_nnx, {"params"})
  out_diff, _ = _max_diff(lin_y, nnx_y)
  grad_diff, grad_worst = 0.0, None
  for path, grad in traverse_util.flatten_dict(lin_grads).items():
    d, _ = _max_diff(grad, mapped[("params", *path)])
    if d > grad_diff:
      grad_diff, grad_worst = d, path_str(("params", *path))
  result = Comparison(out_diff, grad_diff, grad_worst, atol)
  if not result.ok:
    linen_events = _linen_events(linen_module, variables, inputs, linen_kwargs, mutable, rngs)
    nnx_events = _nnx_events(nnx.clone(model), inputs, nnx_kwargs)
    result.first_difference = _bisect(plan, linen_events, nnx_events, atol)
  return result
