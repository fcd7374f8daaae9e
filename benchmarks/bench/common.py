"""What benchmarks/run.py and the benchmarks share: the plain run of a command, the figures every
script's metrics file has, medians, and the helpers that write table cells.

Not a benchmark (it has no NAME): bench.load() passes it over.
"""
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
MIB = 2**20
STDERR_TAIL = 40  # lines of a failed run's stderr to show


def log(message):
    """Progress and failures go to stderr as the runs go; the tables go to stdout at the end."""
    print(message, file=sys.stderr, flush=True)


def at_least_one(args, error, *flags):
    """error() for the first of flags (argparse's dest names) whose value is below 1."""
    for flag in flags:
        if getattr(args, flag) < 1:
            error(f"--{flag.replace('_', '-')} must be at least 1")


def torchrun_command(config, metrics_path, torchrun_flags=()):
    """A run's command: its script under torch.distributed.run, one process per rank."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(config["world_size"]), *torchrun_flags,
            *script_command(config, metrics_path)]


def script_command(config, metrics_path):
    """The script, its arguments and --metrics-json: what follows python or torchrun."""
    return [str(REPO / config["script"]), *config["args"], "--metrics-json", str(metrics_path)]


def run_plain(command, workdir, env, timeout):
    """Run command in workdir: (returncode, stdout, stderr, {}). After timeout seconds it is
    stopped, and its stderr says so."""
    proc = subprocess.Popen(command, cwd=workdir, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # torchrun passes SIGTERM on to its workers
        stdout, stderr = proc.communicate()
        stderr += f"\nharness: killed after --timeout {timeout} s"
    return proc.returncode, stdout, stderr, {}


def stderr_tail(stderr):
    """The end of the workers' stderr.

    torchrun's own failure report (its traceback) follows it and is cut.
    """
    lines = stderr.splitlines()
    cut = next((i for i, line in enumerate(lines) if "torch/distributed/elastic/" in line),
               len(lines))
    return "\n".join(lines[:cut][-STDERR_TAIL:] or lines[-STDERR_TAIL:])


def memory_figures(metrics):
    """The figures every script's metrics file has: training state and peak memory per rank."""
    return {"state_mib": metrics["train_state_bytes"] / MIB,
            "peak_mib": metrics["peak_memory_bytes"] / MIB}


def steady_epoch_time(epoch_times):
    """Median of the epochs after the first (which also pays for warm-up), or the only epoch."""
    return statistics.median(epoch_times[1:] or epoch_times)


def median(config, key):
    """The median over a configuration's runs.

    None when it was not run (or not yet) or failed, or a run lacks the figure.
    """
    if config is None or config["failed"] or not config["figures"]:
        return None
    values = [f[key] for f in config["figures"]]
    return None if None in values else statistics.median(values)


def find(configs, **fields):
    """The first of configs with these values, or None."""
    return next((c for c in configs if all(c.get(k) == v for k, v in fields.items())), None)


def flagged(text, *configs):
    """A row's label: text, and (FAILED) when any of configs failed."""
    return text + (" (FAILED)" if any(c["failed"] for c in configs) else "")


def repeats_said(repeats):
    """A benchmark's own count of runs (--hf-load-repeats, --gpu-check-repeats), as said."""
    return "one run" if repeats == 1 else f"median of {repeats} runs"


def runs_said(args):
    """How many runs each figure is the median of, as the captions say it."""
    said = f"median of {args.repeats} run{'s' if args.repeats > 1 else ''}"
    return said + (" (SMOKE RUN, not figures to quote)" if args.smoke else "")


def where(device):
    """A table title's note on where its runs ran."""
    return "CPU, gloo" if device == "cpu" else "GPU, NCCL, world size 1"


def peak_label(device):
    """The peak memory column's header: the process's RSS on CPU, CUDA's allocator on a GPU."""
    return {"cpu": "peak RSS / rank (MiB)", "cuda": "peak CUDA allocated (MiB)"}[device]


def fmt(value, spec):
    """A table cell: the formatted number, or n/a where there is none (a failed baseline, say)."""
    return "n/a" if value is None else format(value, spec)


def ratio(a, b):
    return a / b if a is not None and b else None


def markdown_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)
