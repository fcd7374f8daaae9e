"""fault-tolerance: a rank killed (4 processes, CPU; torchft and psutil needed).

fsdp2_transformer.py's default model, a rank of the second replica killed (SIGKILL) at step 25
with sharded checkpoints every 10 steps: torchft's replica groups (--fault-tolerance, 2 groups of
2 ranks) against a full restart (HSDP on 4 ranks, torchrun --max-restarts 1). From the step
lines' times: the survivors' longest pause, the seconds from the kill to the first new step and
to the killed replica's first step once back; the steps run again and those the survivors
trained alone. The ways take turns.
"""
import re
import statistics
import subprocess
import sys
import threading
import time

from . import common
from .common import find, flagged, fmt, markdown_table, median, runs_said

NAME, ORDER = "fault-tolerance", 130
TAKES_TURNS = True
# FSDP2's default model, a step line per step, a sharded checkpoint every 10 steps; SIGKILL of
# the second replica's second rank once a line says step 25 (the full restart then trains steps
# 21-25 again from step 20's checkpoint). 200 steps: the killed group restarts and heals (about
# 15 s on 2 busy cores) while the other still trains.
RUN = ["--steps", "200", "--log-every", "1", "--checkpoint-dir", "ckpt", "--checkpoint-format",
       "sharded", "--save-every", "10", "--cpu"]
KILL_STEP = 25
# way: (its flags, how it starts, the process killed: its arguments and environment, and the
# line that says the killed replica is back)
WAYS = {
    "torchft: 2 replica groups of 2 ranks (--fault-tolerance --world-size 2)": (
        ["--fault-tolerance", "--world-size", "2"],
        # python starts the groups; each group's metrics file, group 0's read
        {"python": True, "metrics_world_size": 2, "metrics_file": "metrics.group0.json"},
        {"args": ["--replica-group", "1"], "env": {"LOCAL_RANK": "1"},
         "back": r"^\[group 1\] step \d+: healed"}),
    "full restart: HSDP on 4 ranks (--replicate-degree 2, torchrun --max-restarts 1)": (
        ["--replicate-degree", "2"], {"torchrun_flags": ["--max-restarts", "1"]},
        {"args": [], "env": {"RANK": "3"}, "back": r"^Resumed from "})}
# A step line of fsdp2_transformer.py, with the replica group's name where it started the groups
STEP_LINE = re.compile(r"^(?:\[group (\d+)\] )?step (\d+) \|")


def check(args, asked, error):
    if asked and not args.dry_run:
        try:
            import psutil  # noqa: F401  (run(): the process to kill)
            import torchft  # noqa: F401  (--fault-tolerance)
        except ImportError as e:
            error(f"fault-tolerance needs torchft and psutil ({e}): pip install -r "
                  "requirements-fault-tolerance.txt -r benchmarks/requirements.txt")


def runs(ctx):
    """4 processes on CPU."""
    return [{"device": "cpu", "world_size": 4, "name": way, "way": way,
             "script": "fsdp2_transformer.py", "args": [*RUN, *flags], "victim": victim, **start}
            for way, (flags, start, victim) in WAYS.items()]


def command(config, metrics_path):
    """torchft's groups: `python SCRIPT`, which starts them; the full restart under torchrun."""
    if config.get("python"):
        return [sys.executable, *common.script_command(config, metrics_path)]
    return common.torchrun_command(config, metrics_path, torchrun_flags=config["torchrun_flags"])


def run(config, command, workdir, env, timeout):
    """command, and a SIGKILL of its worker named by the config's victim (arguments in its
    command line, variables of its environment) once a step line says KILL_STEP.
    seen: the figures from the times the step lines came (seconds from the kill); a status of 1
    where the kill or a step it times did not happen."""
    import psutil  # (benchmarks/requirements.txt)

    victim = config["victim"]
    proc = subprocess.Popen(command, cwd=workdir, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    lines, errors = [], []  # (seconds, line)

    def read(stream, into):
        for line in stream:
            into.append((time.monotonic(), line))

    readers = [threading.Thread(target=read, args=(proc.stdout, lines)),
               threading.Thread(target=read, args=(proc.stderr, errors))]
    for reader in readers:
        reader.start()

    def steps():  # (seconds, group or None, step) of each step line so far
        found = ((at, STEP_LINE.match(line)) for at, line in list(lines))
        return [(at, m[1] and int(m[1]), int(m[2])) for at, m in found if m]

    killed, deadline = None, time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline and killed is None:
        if any(step == KILL_STEP for _, _, step in steps()):
            workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                       if "torch.distributed.run" not in p.cmdline()]
            for worker in workers:
                cmdline, environ = " ".join(worker.cmdline()), worker.environ()
                if (" ".join(victim["args"]) in cmdline
                        and all(environ.get(k) == v for k, v in victim["env"].items())):
                    worker.kill()
                    killed = time.monotonic()
                    break
        time.sleep(0.02)
    try:
        proc.wait(max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()
    for reader in readers:
        reader.join()
    stdout, stderr = "".join(line for _, line in lines), "".join(line for _, line in errors)
    if proc.returncode != 0 or killed is None:
        return proc.returncode or 1, stdout, stderr + "\nharness: the kill did not happen", {}
    seen = steps()
    survivors = [(at, step) for at, group, step in seen if group in (0, None)]
    # Lines of steps done before the kill may come just after it: 0.3 s to arrive
    last = max(step for at, step in survivors if at <= killed + 0.3)
    new = [at for at, step in survivors if at > killed + 0.3 and step > last]
    from_kill = [at for at, _ in survivors if at >= max(a for a, _ in survivors if a <= killed)]
    back = [at for at, line in lines if at > killed and re.search(victim["back"], line)]
    rejoined = [at for at, group, _ in seen if back and at >= back[0]
                and group == (1 if victim["args"] else None)]
    if not (new and rejoined):
        return 1, stdout, stderr + "\nharness: no step after the kill, or no rejoin", {}
    before = [at for at, step in survivors if at <= killed and step > 5]
    return proc.returncode, stdout, stderr, {"kill": {
        "step_ms": 1000 * statistics.median(b - a for a, b in zip(before, before[1:])),
        "pause_s": max(b - a for a, b in zip(from_kill, from_kill[1:])),
        "new_step_s": new[0] - killed, "rejoined_s": rejoined[0] - killed,
        "steps_again": len(survivors) - len({step for _, step in survivors}),
        "steps_alone": len([at for at, _ in survivors if killed < at < rejoined[0]])}}


def figures(config, metrics, stdout, seen):
    """Group 0's (or the job's) last loss, and the times run() took from the step lines."""
    return {**common.memory_figures(metrics), "final_loss": metrics["losses"][-1], **seen["kill"]}


def tables(ctx, configs):
    rows = []
    for way in WAYS:
        c = find(configs, way=way)
        rows.append([flagged(way, c), fmt(median(c, "step_ms"), ".0f"),
                     fmt(median(c, "pause_s"), ".2f"), fmt(median(c, "new_step_s"), ".2f"),
                     fmt(median(c, "rejoined_s"), ".1f"), fmt(median(c, "steps_again"), ".0f"),
                     fmt(median(c, "steps_alone"), ".0f"), fmt(median(c, "final_loss"), ".3f")])
    return ["\n### A rank killed: torchft's replica groups against a full restart "
            "(4 processes, CPU, gloo)\n",
            f"fsdp2_transformer.py's default model, `{' '.join(RUN)}`; SIGKILL of the second "
            f"replica's second rank once a step line says step {KILL_STEP}. By the times the "
            "step lines came (the survivors: torchft's group 0; in a full restart, every rank): "
            "the survivors' longest pause between two steps from the kill on; the seconds from "
            "the kill to the first step past those done before it (their lines may come up to "
            "0.3 s after it), and to the killed replica's first step once it is back (healed, or "
            "resumed). Steps again: steps trained a second time (from the last checkpoint); steps "
            "alone: those the survivors trained before the killed replica was back (its rows "
            f"skipped). Step time: the median before the kill. Final loss: group 0's, or the "
            f"job's; the {runs_said(ctx.args)}, the ways taking turns.\n",
            markdown_table(["way", "step time (ms)", "survivors' longest pause (s)",
                            "kill -> first new step (s)", "kill -> killed replica back (s)",
                            "steps again", "steps alone", "final loss"], rows)]
