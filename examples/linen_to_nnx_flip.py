"""Train llama-tiny in Linen, flip it to NNX halfway, and check the loss curve does not notice.

Run A trains in pure Linen for `--steps` steps. Run B trains the same config
in Linen up to the halfway checkpoint, then resumes that checkpoint with all
three NNX flags on and finishes. Both backends declare the same parameter tree
and write the same checkpoint layout, so the two curves should be identical.

    python examples/linen_to_nnx_flip.py --steps 300 --output runs/flip-demo --plot loss.png
"""

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display needed: the plot only goes to a file
import matplotlib.pyplot as plt
from matplotlib import ticker

import maxbridge as mb
from maxbridge.core import files
from maxbridge.training import recipe

# NNX is the default (base.yml, as in MaxText); the Linen runs say so.
LINEN_FLAGS = dict(pure_nnx=False, enable_nnx=False, pure_nnx_decoder=False)
NNX_FLAGS = dict(pure_nnx=True, enable_nnx=True, pure_nnx_decoder=True)
LINEN_ONLY, FLIPPED = "linen-only", "linen-to-nnx"
RELATIVE_TOLERANCE = 1e-5  # what tests/test_train.py demands of the same comparison


def make_config(run_name: str, output: Path, steps: int, flags: dict[str, bool]) -> mb.Config:
  return mb.load_config(
      "llama-tiny",
      run_name=run_name,
      base_output_directory=str(output),
      steps=steps,
      checkpoint_period=steps // 2,  # run B flips at this checkpoint
      eval_interval=steps // 2,  # eval at the flip and at the end
      **flags,
  )


def clear_demo_runs(output: Path) -> None:
  # A run directory that holds checkpoints resumes, so a second `make run`
  # would train nothing. Start both runs from scratch by deleting this demo's
  # own run directories; a folder holding anything else is refused, not wiped.
  if output.exists():
    strangers = sorted(p.name for p in output.iterdir() if p.name not in (LINEN_ONLY, FLIPPED))
    if strangers:
      sys.exit(f"--output {output} holds {strangers}, which this demo did not write; " "pass a new or empty folder")
  for name in (LINEN_ONLY, FLIPPED):
    shutil.rmtree(output / name, ignore_errors=True)


def relative_difference(a: float, b: float) -> float:
  return abs(a - b) / max(abs(a), 1e-12)


def print_comparison(linen_only: list[dict], flipped: list[dict], backends: list[str], flip: int) -> None:
  """Prints the table, the largest differences, and whether the curves match."""
  steps = len(linen_only)
  every = max(steps // 10, 1)
  print(f"\n{'step':>5}  {'linen-only':>10}  {'flipped':>10}  {'by':<5}  {'|difference|':>12}  eval loss (A / B)")
  for i in sorted(set(range(0, steps, every)) | {flip - 1, flip, steps - 1}):
    a, b = linen_only[i]["loss"], flipped[i]["loss"]
    evals = f"  {linen_only[i]['eval_loss']:.6f} / {flipped[i]['eval_loss']:.6f}" if "eval_loss" in linen_only[i] else ""
    print(f"{i:>5}  {a:>10.6f}  {b:>10.6f}  {backends[i]:<5}  {abs(a - b):>12.3e}{evals}")

  differences = [abs(a["loss"] - b["loss"]) for a, b in zip(linen_only, flipped)]
  eval_pairs = [(a["eval_loss"], b["eval_loss"]) for a, b in zip(linen_only, flipped) if "eval_loss" in a]
  final_a, final_b = eval_pairs[-1]
  print(
      f"\nmax |difference|: {max(differences):.3e} over all {steps} steps, "
      f"{max(differences[flip:]):.3e} over the NNX half (steps {flip}-{steps - 1})"
  )
  print(
      f"final eval loss: linen-only {final_a:.6f}, flipped {final_b:.6f} " f"(|difference| {abs(final_a - final_b):.3e})"
  )

  worst = max(
      relative_difference(a, b) for a, b in [(x["loss"], y["loss"]) for x, y in zip(linen_only, flipped)] + eval_pairs
  )
  if worst <= RELATIVE_TOLERANCE:
    print(f"curves match (max relative difference {worst:.1e} <= {RELATIVE_TOLERANCE:.0e})")
    return
  print(
      f"\n{'!' * 72}\nWARNING: THE CURVES DIFFER: max relative difference {worst:.1e} > "
      f"{RELATIVE_TOLERANCE:.0e}.\nThe NNX resume did not continue the Linen run exactly.\n{'!' * 72}",
      file=sys.stderr,
  )


def save_plot(path: Path, linen_only: list[dict], flipped: list[dict], flip: int) -> None:
  steps = range(len(linen_only))
  fig, (top, bottom) = plt.subplots(
      2,
      1,
      figsize=(8, 6),
      sharex=True,
      gridspec_kw=dict(height_ratios=[3, 1]),
  )
  # Run A underneath, thick and grey; run B on top, thin: where they agree,
  # the coloured line runs down the middle of the grey one.
  top.plot(steps, [r["loss"] for r in linen_only], color="0.75", linewidth=5, label="linen-only (run A)")
  top.plot(
      steps[:flip],
      [r["loss"] for r in flipped[:flip]],
      color="tab:blue",
      linewidth=1.2,
      label="flipped (run B), Linen part",
  )
  top.plot(
      steps[flip:],
      [r["loss"] for r in flipped[flip:]],
      color="tab:orange",
      linewidth=1.2,
      label="flipped (run B), NNX part",
  )
  for records, style in ((linen_only, dict(color="0.5", markersize=11)), (flipped, dict(color="black", markersize=5))):
    evals = [(i, r["eval_loss"]) for i, r in enumerate(records) if "eval_loss" in r]
    top.plot(*zip(*evals), linestyle="none", marker="o", **style)
  top.plot([], [], linestyle="none", marker="o", color="black", label="eval loss (A grey, B black)")
  top.set_yscale("log")
  plain = ticker.FuncFormatter(lambda y, _: f"{y:g}")
  top.yaxis.set_major_formatter(plain)
  top.yaxis.set_minor_formatter(plain)
  top.set_ylabel("loss (log scale)")
  top.set_title(f"llama-tiny: {len(linen_only)} steps in Linen vs Linen → NNX at step {flip}")
  top.legend()

  relative = [relative_difference(a["loss"], b["loss"]) for a, b in zip(linen_only, flipped)]
  bottom.plot(steps, relative, color="tab:red", linewidth=1)
  bottom.axhline(RELATIVE_TOLERANCE, color="tab:red", linestyle=":", linewidth=1)
  bottom.text(0, RELATIVE_TOLERANCE, f" tolerance {RELATIVE_TOLERANCE:.0e}", color="tab:red", va="bottom", fontsize=8)
  bottom.set_ylim(-0.1 * RELATIVE_TOLERANCE, max(2 * RELATIVE_TOLERANCE, 1.1 * max(relative)))
  if max(relative) == 0:
    bottom.text(
        0.5,
        0.25,
        "identical at every step",
        transform=bottom.transAxes,
        ha="center",
        color="tab:red",
        bbox=dict(facecolor="white", edgecolor="none"),
    )
  bottom.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
  bottom.set_ylabel("relative\n|difference|")
  bottom.set_xlabel("step")
  for ax in (top, bottom):
    ax.axvline(flip - 0.5, color="black", linestyle="--", linewidth=1)
    ax.grid(alpha=0.3)
  top.annotate(
      "flip to NNX", xy=(flip - 0.5, 1), xycoords=("data", "axes fraction"), xytext=(4, -14), textcoords="offset points"
  )
  fig.tight_layout()

  # Render beside the target, then rename: a reader never sees half a PNG.
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
  os.close(fd)
  try:
    fig.savefig(tmp, format="png", dpi=120)
    files.apply_umask(tmp, directory=False)  # mkstemp makes it 0600; the PNG is the user's like any file
    os.replace(tmp, path)
  except BaseException:
    os.unlink(tmp)
    raise
  finally:
    plt.close(fig)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--steps", type=int, default=300, help="steps per run (default 300)")
  parser.add_argument(
      "--output",
      type=Path,
      default=Path("runs/flip-demo"),
      help="folder for the two run directories; cleared first (default runs/flip-demo)",
  )
  parser.add_argument("--plot", type=Path, default=Path("loss.png"), help="PNG to write (default loss.png)")
  args = parser.parse_args()
  if args.steps < 2:
    parser.error(f"--steps must be at least 2 to flip halfway, got {args.steps}")
  steps, flip = args.steps, args.steps // 2
  clear_demo_runs(args.output)
  began = time.perf_counter()

  # Run A: pure Linen from start to finish. Its trainer (the compiled Linen
  # step) serves run B's Linen half too: the two configs differ in run_name only.
  linen_config = make_config(LINEN_ONLY, args.output, steps, LINEN_FLAGS)
  linen = recipe.create_trainer(linen_config)
  linen_only = mb.train(linen_config, trainer=linen, progress=True)

  # Run B: Linen up to the halfway checkpoint, then the same run directory
  # with every part in NNX. until_step stops the call without shortening the
  # LR schedule, so the second call continues the same run.
  linen_part = mb.train(
      make_config(FLIPPED, args.output, steps, LINEN_FLAGS), trainer=linen, until_step=flip, progress=True
  )
  nnx_part = mb.train(make_config(FLIPPED, args.output, steps, NNX_FLAGS), progress=True)
  flipped = linen_part + nnx_part
  if [r["step"] for r in flipped] != list(range(steps)):
    sys.exit(
        f"run B logged steps {[r['step'] for r in flipped][:3]}...; expected 0..{steps - 1} "
        f"with the NNX call resuming at step {flip}"
    )
  backends = ["linen"] * len(linen_part) + ["nnx"] * len(nnx_part)
  seconds = time.perf_counter() - began

  print_comparison(linen_only, flipped, backends, flip)
  save_plot(args.plot, linen_only, flipped, flip)
  print(
      f"wrote {args.plot}; runs in {args.output}/{{{LINEN_ONLY},{FLIPPED}}}; "
      f"trained {2 * steps} steps in {seconds:.0f} s"
  )


if __name__ == "__main__":
  main()
