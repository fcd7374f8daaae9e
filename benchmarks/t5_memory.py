"""The picture of `benchmarks/run.py --only lora`: T5's memory per rank against world size.

    python benchmarks/t5_memory.py SCRIPT RUNS_JSON OUT_JSON     (run.py runs it)

runs `SCRIPT --plan ... --metrics-json` once per argument list in RUNS_JSON (a JSON list of
lists) and writes the plans, in order, to OUT_JSON. The runs share this one process (runpy: the
script's own command line, its imports paid once): 0.5 s a plan instead of 13 s a process on a
2-core machine, and the picture needs over a hundred of them.

draw() renders the picture from those plans and the measured runs. matplotlib, a dependency of
the benchmarks only (benchmarks/requirements.txt), is imported there and nowhere else.
"""
import contextlib
import io
import json
import runpy
import shlex
import sys
import tempfile
from pathlib import Path

GIB = 2**30


def run_plans(script, runs):
    """The plan (the --metrics-json's "plan") of `script --plan *argv` for each argv in runs."""
    sys.path.insert(0, str(Path(script).parent))  # as for `python SCRIPT`: its own imports
    plans = []
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "plan.json"
        for argv in runs:
            sys.argv = [script, *argv, "--metrics-json", str(metrics)]
            printed = io.StringIO()  # the plan as text, for people: not needed here
            try:
                with contextlib.redirect_stdout(printed):
                    runpy.run_path(script, run_name="__main__")
                code = "no exit"  # --plan always exits
            except SystemExit as e:
                code = e.code
            if code not in (0, None):  # the script's own error line went to stderr
                sys.exit(f"error: {shlex.join([script, *argv])} ended with {code}\n"
                         f"{printed.getvalue()}")
            plans.append(json.loads(metrics.read_text())["plan"])
            metrics.unlink()
    return plans


def draw(path, title, curves, measured, note=""):
    """Write a PNG of two panels, memory per rank (GiB, log scale) against world size (log 2):
    the training state (parameters + gradients + AdamW state) and the predicted peak.

    curves: [{"label", "colour", "linestyle", "world_sizes", "train_state", "peak"}] (bytes per
    rank; "linewidth" and "in_legend" optional). measured: [{"label", "colour", "world_size",
    "train_state", "peak"}], markers: the train state on its curve, the peak (process RSS on
    CPU) hollow. note: a line of small print under the panels."""
    try:
        import matplotlib
    except ImportError:
        sys.exit("error: the memory picture needs matplotlib: "
                 "pip install -r benchmarks/requirements.txt")
    matplotlib.use("Agg")  # a file, no display
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullLocator

    figure, axes = plt.subplots(1, 2, figsize=(14, 7.2), sharex=True)
    panels = [("train_state", "Training state per rank: parameters + gradients + AdamW state"),
              ("peak", "Peak per rank: --plan's prediction (lines), measured RSS (markers)")]
    for ax, (key, panel_title) in zip(axes, panels):
        for curve in curves:
            ax.plot(curve["world_sizes"], [b / GIB for b in curve[key]], color=curve["colour"],
                    linestyle=curve["linestyle"], linewidth=curve.get("linewidth", 2),
                    marker=".", markersize=5,
                    label=curve["label"] if curve.get("in_legend", True) else None)
        for point in measured:
            ax.plot([point["world_size"]], [point[key] / GIB], linestyle="none",
                    marker="o" if key == "train_state" else "D", markersize=9,
                    markeredgewidth=1.5, markeredgecolor=point["colour"],
                    markerfacecolor=point["colour"] if key == "train_state" else "none")
        world_sizes = sorted({n for curve in curves for n in curve["world_sizes"]})
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_locator(FixedLocator(world_sizes))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: f"{x:g}"))
        ax.set_yscale("log")
        # Plain GiB figures (0.05, 1, 4) rather than powers of ten
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1, 2, 3, 5)))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
        ax.set_xlabel("world size (ranks)")
        ax.set_ylabel("GiB per rank (log scale)")
        ax.set_title(panel_title, fontsize=11)
        ax.grid(True, which="major", alpha=0.3)
    # One legend for both panels, under them; the markers' meaning as entries without a curve
    handles, labels = axes[0].get_legend_handles_labels()
    for marker, face, label in (("o", "gray", "measured at world size 2: train_state_bytes"),
                                ("D", "none", "measured at world size 2: peak RSS (CPU)")):
        handles += axes[0].plot([], [], marker, color="gray", markerfacecolor=face,
                                markersize=8)
        labels.append(label)
    figure.legend(handles, labels, loc="lower center", ncol=3, fontsize=9, frameon=False,
                  bbox_to_anchor=(0.5, 0.06 if note else 0))
    figure.suptitle(title, fontsize=13)
    if note:
        figure.text(0.5, 0.005, note, ha="center", va="bottom", fontsize=8.5, wrap=True)
    figure.tight_layout(rect=(0, 0.2 if note else 0.15, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return Path(path)


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__.split("\n\n")[1])
    script, runs, out = sys.argv[1:]
    Path(out).write_text(json.dumps(run_plans(script, json.loads(Path(runs).read_text()))))
