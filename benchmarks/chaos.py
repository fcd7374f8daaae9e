"""Random-kill harness: does training recover, exactly, from workers killed at random moments?

For each case it runs the script twice under torch.distributed.run: once uninterrupted, and once
with --max-restarts while a killer SIGKILLs a random rank at random moments (often while a
checkpoint is being written; never before the first checkpoint is complete), --kills times. torchrun
restarts all workers after each kill; they resume from the newest complete checkpoint. The case
recovered when the killed run ends with exit status 0, its final checkpoint holds exactly (bit for
bit) the uninterrupted run's tensors, and every step (or epoch) loss it printed equals the
uninterrupted run's.

    python benchmarks/chaos.py                                   # every case, 20 kills each
    python benchmarks/chaos.py --cases sharded-async --kills 5 --out chaos.md

Cases: FSDP2 with full checkpoints (DTensor API), sharded checkpoints, and sharded asynchronous
checkpoints, one checkpoint per step; T5 with sharded checkpoints and --resume auto, one per epoch.
The disk-full cases put FSDP2's checkpoints on a tmpfs (root only; 16 MiB + 1 MiB per step, room for
every checkpoint the run keeps, about 0.5 MiB each, so that only the filler fills it) that another
process fills at a random moment once a checkpoint is complete, --fills times: each stop must be one
line about space, and the same command, once space is freed, must resume to the uninterrupted run's
final state. Cases with the same command (sharded-async and disk-full-sharded-async) share one
uninterrupted run.
The fixtures are the tests' (tests/tiny_wikihow.py), written into a temporary folder.
"""
import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
from conftest import (  # noqa: E402  (the tests' helpers: a reader of either checkpoint format)
    checkpoint_writers,
    full_state_of,
    processes_left,
)

FSDP2 = ["--vocab-size", "64", "--dim", "32", "--n-layers", "3", "--seq-len", "16",
         "--batch-size", "8", "--log-every", "1", "--save-every", "1", "--checkpoint-dir", "ckpt"]
ASYNC = [*FSDP2, "--checkpoint-format", "sharded", "--async-checkpoint"]
CASES = {  # name: (script, arguments, the printed line of a step's loss)
    "full": ("fsdp2_transformer.py", FSDP2, r"step (\d+) \| loss (\S+)"),
    "sharded": ("fsdp2_transformer.py", [*FSDP2, "--checkpoint-format", "sharded"],
                r"step (\d+) \| loss (\S+)"),
    "sharded-async": ("fsdp2_transformer.py", ASYNC, r"step (\d+) \| loss (\S+)"),
    # The same run, each kill while a background write is under way (a .tmp folder exists): of a
    # training process (its writer is left to itself), or of a checkpoint writer process alone.
    "async-kill-training-while-writing": ("fsdp2_transformer.py", ASYNC,
                                          r"step (\d+) \| loss (\S+)"),
    "async-kill-writer-while-writing": ("fsdp2_transformer.py", ASYNC,
                                        r"step (\d+) \| loss (\S+)"),
    "t5-sharded": ("t5_fsdp_finetune.py",
                   ["--input-length", "32", "--output-length", "16", "--num-train-samples", "32",
                    "--num-val-samples", "8", "--lr", "0.01", "--checkpoint-type", "sharded",
                    "--resume", "auto", "--no-track-memory", "--save-dir", "."],
                   r"Train Epoch: \t(\d+), Loss: \t(\S+)"),
}


# FSDP2 with its checkpoints on a small disk that another process fills (root only: a tmpfs)
DISK_CASES = ["disk-full-full", "disk-full-sharded", "disk-full-sharded-async"]


def workers(agent_pid):
    """{rank: pid} of the worker processes an agent has started (its children with RANK set)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except (OSError, ValueError):  # gone meanwhile
            continue
        if parent == agent_pid and b"RANK" in env:
            found[int(env[b"RANK"])] = int(pid)
    return found


def run(script, args, pattern, cwd, nproc, kills=0, seed=0, timeout=1800, target=None):
    """Run the script under torchrun in cwd, killing a random worker `kills` times: once per
    attempt (torchrun's restart), after the attempt has printed a step's (epoch's) loss, matched by
    pattern, and a checkpoint is complete, and then a random pause of up to 1 s or (a third of the
    time) as soon as a checkpoint is being written. target "training" or "writer": always while
    a checkpoint is being written, a worker or a checkpoint writer process. Returns (exit status,
    output, kills, kills while a checkpoint was half-written, processes left running)."""
    rng = random.Random(seed)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(nproc), "--max-restarts", str(kills), str(REPO / script), *args]
    with open(cwd / "output.txt", "w") as output:
        agent = subprocess.Popen(command, cwd=cwd, stdout=output, stderr=subprocess.STDOUT)
    done, during_save, deadline, attempts = 0, 0, time.monotonic() + timeout, set()
    try:
        while done < kills and agent.poll() is None and time.monotonic() < deadline:
            found = workers(agent.pid)
            printed = len(re.findall(pattern, read(cwd)))
            if len(found) < nproc or frozenset(found.values()) in attempts:
                time.sleep(0.05)
                continue
            saved = read(cwd).count("Saved") if target else 0  # target: one of this attempt's
            while agent.poll() is None and (len(re.findall(pattern, read(cwd))) == printed
                                            or read(cwd).count("Saved") <= saved):
                time.sleep(0.02)  # until this attempt has trained a step (an epoch), and a
                # checkpoint is complete: a kill before the first one tests only a fresh start
            if target or rng.random() < 1 / 3:  # wait for a checkpoint write to be under way
                time.sleep(rng.uniform(0, 1.0) if target else 0)  # (some saves later)
                limit = time.monotonic() + 5
                while not writing(cwd) and time.monotonic() < limit:
                    time.sleep(0.001)
            else:
                time.sleep(rng.uniform(0, 1.0))
            if agent.poll() is not None:
                break
            victims = list(found.values())
            if target == "writer":
                victims = checkpoint_writers(set(victims))
            if not victims:
                continue  # (no writer process at this moment: look again)
            victim, saving = rng.choice(victims), writing(cwd)
            try:
                os.kill(victim, signal.SIGKILL)
            except ProcessLookupError:  # ended since it was found: its attempt failed, or the run
                # ended (the killer, at the lowest priority, slept past its last step)
                print(f"pid {victim} ended before its kill: looking again", file=sys.stderr)
                continue
            during_save += saving
            attempts.add(frozenset(found.values()))
            done += 1
        agent.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        if agent.poll() is None:
            agent.kill()
    return agent.returncode, read(cwd), done, during_save, processes_left(cwd)


def writing(cwd):
    """Whether a checkpoint is being written: a .tmp folder of a later step (epoch) than every
    complete checkpoint (an older one is the leftover of a kill)."""
    def number(path):
        digits = re.findall(r"\d+", path.name)
        return int(digits[-1]) if digits else -1

    complete = [*cwd.rglob("COMPLETE"), *cwd.rglob("trainer_state.json")]
    newest = max((number(marker.parent) for marker in complete), default=-1)
    return any(number(path) > newest for path in cwd.rglob("*.tmp"))


def read(cwd):
    return (cwd / "output.txt").read_text(errors="replace")


def losses(output, pattern):
    """{step: [every loss printed for it]} (a step retrained after a kill prints again)."""
    found = {}
    for step, loss in re.findall(pattern, output):
        found.setdefault(int(step), []).append(loss)
    return found


def final_checkpoint(cwd):
    marked = [p.parent for p in cwd.rglob("COMPLETE")] + [p.parent for p in
                                                          cwd.rglob("trainer_state.json")]
    return max(marked, key=lambda p: int(re.findall(r"\d+", p.name)[-1]))


STRAIGHT = {}  # (script, arguments): (folder, run): cases with the same run share it


def straight_run(script, args, pattern, workdir):
    """The uninterrupted run of script with args (once per distinct command): (folder, (exit
    status, output, 0, 0))."""
    key = (script, tuple(args))
    if key not in STRAIGHT:
        cwd = workdir / f"straight-{len(STRAIGHT)}"
        cwd.mkdir(parents=True)
        STRAIGHT[key] = cwd, run(script, args, pattern, cwd, 2)
    return STRAIGHT[key]


def chaos_case(name, kills, steps, seed, workdir, fixtures):
    """Run one case straight and with kills; return a dict of what happened."""
    import torch
    script, args, pattern = CASES[name]
    args = [*args, *(["--steps", str(steps)] if script.startswith("fsdp2") else
                     ["--epochs", str(steps), "--model-name", str(fixtures[1]), "--data-dir",
                      str(fixtures[0])])]
    folders, results = {}, {}
    folders["straight"], results["straight"] = straight_run(script, args, pattern, workdir)
    folders["killed"] = workdir / name / "killed"
    folders["killed"].mkdir(parents=True)
    target = re.search(r"async-kill-(training|writer)", name)
    results["killed"] = run(script, args, pattern, folders["killed"], 2, kills=kills, seed=seed,
                            target=target and target[1])
    status, output, done, during_save, left = results["killed"]
    straight, killed = (losses(results[m][1], pattern) for m in ("straight", "killed"))
    same_losses = all(all(loss == straight[step][0] for loss in printed)
                      for step, printed in killed.items()) and set(killed) == set(straight)
    final = {m: full_state_of(final_checkpoint(folders[m])) for m in ("straight", "killed")}
    same_state = (results["straight"][0] == 0 and final["straight"].keys() == final["killed"].keys()
                  and all(torch.equal(final["straight"][k], final["killed"][k])
                          for k in final["straight"]))
    return {"case": name, "kills": done, "during_save": during_save, "exit_status": status,
            "recovered": status == 0 and same_losses and same_state and not left,
            "same_losses": same_losses, "same_final_state": same_state,
            "restarts": output.count("Resumed from"), "processes_left": len(left)}


def disk_full_case(name, fills, steps, seed, workdir):
    """Run FSDP2 (the format of `name`: disk-full-full, disk-full-sharded...) once on an ample disk,
    and once with its --checkpoint-dir on a small tmpfs that another process fills at a random
    moment, `fills` times: each time the run must stop in one error line that speaks of space
    (refused before the save, or ENOSPC during it), keep its complete checkpoints, and, once the
    filler's file and all but the newest checkpoint are deleted, resume with the same command.
    Needs root (mount)."""
    import torch
    rng, pattern = random.Random(seed), CASES["full"][2]
    args = [*FSDP2, *CASES[name.removeprefix("disk-full-")][1][len(FSDP2):], "--steps", str(steps)]
    straight, (status, straight_output, *_) = straight_run("fsdp2_transformer.py", args,
                                                             pattern, workdir)
    cwd = workdir / name / "filled"
    (cwd / "ckpt").mkdir(parents=True)
    # The script keeps every checkpoint (one per step here, about 0.5 MiB): the disk must hold
    # them all, or the run would fill it itself once the filler's space is freed.
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={16 + steps}m", "tmpfs", cwd / "ckpt"],
                   check=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", str(REPO / "fsdp2_transformer.py"), *args]
    outputs, stops, unclean = [], {"before the save": 0, "during the save": 0, "other": 0}, []
    try:
        while True:
            with open(cwd / "output.txt", "w") as output:
                agent = subprocess.Popen(command, cwd=cwd, stdout=output, stderr=subprocess.STDOUT)
            filled = len(outputs) < fills
            if filled:  # another process fills the disk while the run saves, step after step
                while agent.poll() is None and not list((cwd / "ckpt").glob("step_*/COMPLETE")):
                    time.sleep(0.01)  # a complete checkpoint, which the rerun must resume
                time.sleep(rng.uniform(0, 1.0))
                fill(cwd / "ckpt" / "filler")
            agent.wait(timeout=600)
            outputs.append(read(cwd))
            if agent.returncode == 0:
                break
            # Rank 0's line; another rank says the same ("error: rank 1: ...") only if it
            # outlives fail()'s 10 s wait: at nice 19 on a busy machine (the tests' Idle run),
            # rank 0's exit and torchrun's stop of the others can take that long.
            errors = {re.sub(r"^error: rank \d+: ", "error: ", line)
                      for line in outputs[-1].splitlines() if line.startswith("error:")}
            said = errors.pop() if len(errors) == 1 else ""  # the one message, or none
            kind = ("before the save" if "not enough space" in said else
                    "during the save" if "no space left" in said else "other")
            stops[kind] += 1
            workers_said = outputs[-1].split("torch/distributed/elastic/multiprocessing")[0]
            if not filled or kind == "other" or "Traceback" in workers_said:
                # not a clean stop for lack of space (torchrun's own report follows it): say why
                unclean = [line for line in workers_said.splitlines()
                           if line.startswith("error:") or "Traceback" in line
                           or re.match(r"\w*(Error|Exception)\b", line)]
                break
            (cwd / "ckpt" / "filler").unlink()  # space freed: the filler's, older checkpoints
            for old in sorted((cwd / "ckpt").glob("step_*"))[:-1]:
                shutil.rmtree(old)
    finally:
        final = full_state_of(final_checkpoint(cwd)) if agent.returncode == 0 else {}
        subprocess.run(["umount", "-l", cwd / "ckpt"], check=False)
    expected = full_state_of(final_checkpoint(straight))
    same_state = status == 0 and final.keys() == expected.keys() and all(
        torch.equal(final[k], expected[k]) for k in expected)
    straight_losses = losses(straight_output, pattern)
    same_losses = all(all(loss == straight_losses[step][0] for loss in printed) for output in
                      outputs for step, printed in losses(output, pattern).items())
    return {"case": name, "fills": sum(stops.values()), "stopped_before_a_save":
            stops["before the save"], "stopped_during_a_save": stops["during the save"],
            "other_stops": stops["other"], "exit_status": agent.returncode,
            "recovered": agent.returncode == 0 and same_state and same_losses,
            "same_losses": same_losses, "same_final_state": same_state,
            "restarts": sum(output.count("Resumed from") for output in outputs),
            "unclean_stop": unclean}  # the lines of a stop that was not one line about space


def fill(path):
    """Append to path until its disk is full, as another process would."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        while True:
            os.write(descriptor, b"\0" * 65536)
    except OSError:  # ENOSPC
        pass
    finally:
        os.close(descriptor)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=[*CASES, *DISK_CASES],
                        default=[*CASES, *DISK_CASES])
    parser.add_argument("--fills", type=int, default=5, help="disk-full cases: times another "
                        "process fills the checkpoint disk")
    parser.add_argument("--kills", type=int, default=20, help="SIGKILLs per killed run")
    parser.add_argument("--steps", type=int, default=400,
                        help="FSDP2 steps (T5 trains --steps // 10 epochs)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the killer's choices")
    parser.add_argument("--out", help="also write the markdown table to this file")
    parser.add_argument("--json", help="write the results as JSON to this file")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="fsdp-chaos-"))
    fixtures = None
    if "t5-sharded" in args.cases:
        from tiny_wikihow import write_tiny_t5, write_wikihow
        from transformers.utils import logging
        logging.disable_progress_bar()  # save_pretrained's "Writing model shards" bar
        fixtures = write_wikihow(workdir / "data"), write_tiny_t5(workdir / "tiny-t5")
    start, rows = time.monotonic(), []
    for name in args.cases:
        steps = args.steps if name != "t5-sharded" else max(2, args.steps // 10)
        rows.append(disk_full_case(name, args.fills, steps, args.seed, workdir)
                    if name in DISK_CASES else
                    chaos_case(name, args.kills, steps, args.seed, workdir, fixtures))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    table = ["| case | kills (disk fills) | during a checkpoint write | restarts that resumed | "
             "recovered, "
             "final state bit-identical | every printed loss identical |",
             "|---|---|---|---|---|---|"]
    for row in rows:
        recovered, same = ("yes" if row[k] else "NO" for k in ("recovered", "same_losses"))
        events = (f"{row['fills']} disk fills | {row['stopped_during_a_save']} (the others "
                  f"refused before writing)" if "fills" in row else
                  f"{row['kills']} | {row['during_save']}")
        table.append(f"| {row['case']} | {events} | {row['restarts']} | {recovered} | {same} |")
    elapsed = time.monotonic() - start
    markdown = "\n".join([*table, "", f"{elapsed:.0f} s; killer seed {args.seed}"])
    print(markdown)
    if args.out:
        Path(args.out).write_text(markdown + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    shutil.rmtree(workdir, ignore_errors=True)
    sys.exit(0 if all(row["recovered"] for row in rows) else 1)


if __name__ == "__main__":
    main()
