"""checkpoint: how long saves pause training (world size 2, CPU: about 11 minutes).

Issue 34's 55M-parameter model, 30 steps, without checkpoints, with synchronous sharded saves
every 3 steps and with the background writer process (--async-checkpoint); --thread-writer-script
adds a row for another copy of the script (the thread writer of main before issue 34). Its runs
take turns (one of each configuration, then again), so that the machine's drift touches every row
alike.
"""
import os
import statistics
import threading

from . import common
from .common import find, flagged, fmt, markdown_table, median, ratio, runs_said

NAME, ORDER = "checkpoint", 50
TAKES_TURNS = True
# issue 34's model (about 660 MB of sharded checkpoint state on 2 ranks), a save every 3 steps;
# the rows differ only in how they save.
MODEL = ["--dim", "768", "--n-layers", "6", "--n-heads", "12", "--vocab-size", "8000",
         "--seq-len", "32", "--batch-size", "4", "--steps", "30", "--log-every", "10"]
SAVES = ["--checkpoint-dir", "ckpt", "--save-every", "3", "--checkpoint-format", "sharded"]
RUNS = {"no checkpoints": [], "synchronous sharded": SAVES,
        "process writer (--async-checkpoint)": [*SAVES, "--async-checkpoint"]}


def add_flags(group):
    group.add_argument("--thread-writer-script", default=None, metavar="FILE",
                       help="checkpoint: also run this copy of fsdp2_transformer.py with "
                            "--async-checkpoint (e.g. main before issue 34, whose writer is a "
                            "thread)")


def runs(ctx):
    scripts = {name: ("fsdp2_transformer.py", flags) for name, flags in RUNS.items()}
    if ctx.args.thread_writer_script:
        scripts["thread writer (--async-checkpoint, --thread-writer-script)"] = (
            os.path.abspath(ctx.args.thread_writer_script), [*SAVES, "--async-checkpoint"])
    return [{"device": "cpu", "world_size": 2, "name": name, "script": script,
             "args": [*MODEL, *flags, "--cpu"]}
            for name, (script, flags) in scripts.items()]


def watch_writers(workdir, finished, seen):
    """Until finished is set, every 0.2 s: the CPU seconds (user + system) so far of each
    checkpoint writer of the run in workdir (DCP's spawned processes, in the run's folder), into
    seen {pid: seconds}. A writer is idle at its end (its last save is waited for): little is
    missed."""
    tick = os.sysconf("SC_CLK_TCK")
    while not finished.wait(0.2):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.readlink(f"/proc/{pid}/cwd") != str(workdir):
                    continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"spawn_main" not in f.read():
                        continue
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                seen[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue


def run(config, command, workdir, env, timeout):
    """The plain run, its checkpoint writers' CPU seconds watched meanwhile."""
    finished, writers = threading.Event(), {}
    watching = threading.Thread(target=watch_writers, args=(workdir, finished, writers))
    watching.start()
    try:
        returncode, stdout, stderr, _ = common.run_plain(command, workdir, env=env, timeout=timeout)
    finally:
        finished.set()
        watching.join()
    return returncode, stdout, stderr, {"writers_cpu_s": sum(writers.values())}


def figures(config, metrics, stdout, seen):
    # Over the whole run, the first step and every pause included (a wait for a copy inside a
    # step counts twice: in the step and in its save's pause).
    stalls, steps = metrics["checkpoint_stall_s"], metrics["step_times_s"][1:]
    return {**common.memory_figures(metrics), "tokens_per_s": metrics["tokens_per_s"],
            "first_pause_s": stalls[0] if stalls else None,
            "later_pause_s": statistics.median(stalls[1:]) if len(stalls) > 1 else None,
            "all_in_tokens_per_s": metrics["tokens_per_s"] * metrics["step_time_s"] * len(steps)
            / (sum(steps) + sum(stalls)),
            # every process of the run, reaped ones (torchrun waits for its workers, each
            # worker for its writer): user + system
            "cpu_s": seen["cpu_s"], "writers_cpu_s": seen["writers_cpu_s"]}


def tables(ctx, configs):
    none, synchronous = (find(configs, name=name) for name in list(RUNS)[:2])
    headers = ["configuration", "tokens/s (steady)", "vs no checkpoints",
               "tokens/s (all steps and pauses)", "vs no checkpoints", "first save's pause (s)",
               "vs synchronous", "later saves' pause, median (s)", "vs synchronous",
               "CPU s, every process", "of which writers"]
    rows = [[flagged(c["name"], c), fmt(median(c, "tokens_per_s"), ",.1f"),
             fmt(ratio(median(c, "tokens_per_s"), median(none, "tokens_per_s")), ".2f"),
             fmt(median(c, "all_in_tokens_per_s"), ",.1f"),
             fmt(ratio(median(c, "all_in_tokens_per_s"), median(none, "all_in_tokens_per_s")),
                 ".2f")]
            + [value for key in ("first_pause_s", "later_pause_s") for value in (
                fmt(median(c, key), ".3f"),
                fmt(ratio(median(c, key), median(synchronous, key)), ".3f"))]
            + [fmt(median(c, "cpu_s"), ".1f"), fmt(median(c, "writers_cpu_s"), ".1f")]
            for c in configs]
    return ["\n### Checkpoint pauses: synchronous, thread and process writers (CPU, gloo)\n",
            f"`{' '.join(MODEL)}` on 2 ranks, saves `{' '.join(SAVES)}`; {runs_said(ctx.args)}, "
            "the configurations taking turns. tokens/s (steady) is the script's (the median "
            "step, pauses left out); tokens/s (all) counts every step after the first and every "
            "pause. A pause is how long a save stopped training, the wait of the next step for "
            "its copy included. CPU s: user + system seconds of the whole run, every process "
            "(start-up included), and of the checkpoint writer processes alone.\n",
            markdown_table(headers, rows)]
