"""gpu-check: what a lent GPU is checked for, in one command of about 8 minutes on one GPU:
`pytest -m gpu -n auto` (the GPU tests side by side on a GPU machine's many cores, a pytest-xdist
worker each), then the headline rows, one run each (--gpu-check-repeats): C1B in bf16 and with
float8 (tokens/s, MFU), C1B's asynchronous saves (the first save's pause and a later one's, saves
100 steps apart: beyond the background write of 12.5 GB), T5 at the lora-gpu rows' shape (t5-base,
512 + 128 tokens, batch 16, bf16) fully fine-tuned and with LoRA, under FSDP1 and FSDP2, eager and
(FSDP2) compiled, and each T5 run's --plan peak against its measured peak. One markdown table, with
the card and the versions."""
import codecs
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import torch

from . import common, fsdp2_gpu, lora_gpu
from .common import fmt, markdown_table, median, ratio

NAME, ORDER = "gpu-check", 5
FIXTURES = {"lora"}
# C1B: fsdp2-gpu's rows, shorter. 30 steps give a steady rate after --compile's first two;
# the asynchronous run saves at steps 100 and 200 and trains step 201, which waits for the second
# save's copy (fsdp2-gpu's "checkpoint sharded --async-checkpoint" row).
C1B_ROWS = {"C1B bf16 --compile --batch-size 16": ["--batch-size", "16", "--compile",
                                                   "--steps", "30"],
            "C1B float8 tensorwise --compile --batch-size 16": [
                "--batch-size", "16", "--compile", "--float8", "tensorwise", "--steps", "30"],
            "C1B --async-checkpoint, saves 100 steps apart": [
                "--batch-size", "8", "--save-every", "100", "--checkpoint-format", "sharded",
                "--async-checkpoint", "--checkpoint-dir", "ckpt", "--steps", "201"]}
# T5: lora-gpu's shape and rows (full fine-tuning, LoRA on an fp32 base), fewer samples.
T5_SAMPLES, T5_EPOCHS = 128, 3
T5_ROWS = {f"T5 {row}, FSDP{version}{', --compile' if compiled else ''}": (flags, version, compiled)
           for row, flags in (("full", []), ("LoRA", ["--lora-rank", "16"]))
           for version, compiled in ((1, False), (2, False), (2, True))}
PYTEST = "pytest -m gpu"
# pytest -m gpu's target is 5 minutes: past 6 it is stopped, its row FAILED with the tests that
# had ended and those running, and the headline rows still get the rest of a lent GPU's time.
PYTEST_LIMIT_S = 360
PARTS = ("pytest", "c1b", "t5")  # the kinds of row, in the order they run


def add_flags(group):
    group.add_argument("--gpu-check-repeats", type=int, default=1, metavar="N",
                       help="gpu-check: runs of each row, the median taken (--repeats is for "
                            "the others); pytest -m gpu runs once")
    group.add_argument("--gpu-check-parts", nargs="+", choices=PARTS, default=list(PARTS),
                       metavar="PART",
                       help=f"gpu-check: the rows to run, any of {', '.join(PARTS)} (pytest -m "
                            "gpu, C1B's three, T5's six): a lent GPU's time split over two "
                            "commands")


def check(args, asked, error):
    common.at_least_one(args, error, "gpu_check_repeats")
    if asked and (args.no_gpu or not torch.cuda.is_available()) and not args.dry_run:
        error("gpu-check checks a CUDA GPU, and none is visible here: run it where one is lent")
    if asked and "pytest" in args.gpu_check_parts and not args.dry_run:
        try:
            import xdist  # noqa: F401 (pytest -n: the GPU tests side by side)
        except ImportError:
            error("gpu-check runs the GPU tests side by side with pytest-xdist, which is not "
                  "installed: pip install -r requirements-test.txt (or leave them out: "
                  "--gpu-check-parts c1b t5)")


def runs(ctx):
    """World size 1 on the first GPU: the GPU tests, C1B's rows, then T5's (those asked for)."""
    repeats = ctx.args.gpu_check_repeats
    configs = [{"device": "cuda", "world_size": 1, "name": PYTEST, "kind": "pytest",
                "script": "tests", "repeats": 1}]
    configs += [{"device": "cuda", "world_size": 1, "name": name, "kind": "c1b",
                 "repeats": repeats, "script": "fsdp2_transformer.py",
                 "args": [*fsdp2_gpu.C1B, *flags, "--log-every", "10"]}
                for name, flags in C1B_ROWS.items()]
    configs += [{"device": "cuda", "world_size": 1, "name": name, "kind": "t5",
                 "repeats": repeats, "samples": T5_SAMPLES, "script": "t5_fsdp_finetune.py",
                 "args": [*t5_args(ctx), *flags, "--fsdp-version", str(version),
                          *(["--compile"] if compiled else [])]}
                for name, (flags, version, compiled) in T5_ROWS.items()]
    return [config for config in configs if config["kind"] in ctx.args.gpu_check_parts]


def t5_args(ctx):
    return ["--model-name", str(ctx.lora_model), "--data-dir", str(ctx.lora_data),
            *lora_gpu.SIZES, "--num-train-samples", str(T5_SAMPLES), "--epochs", str(T5_EPOCHS),
            "--no-run-validation", "--no-save-model"]


def command(config, metrics_path):
    if config["kind"] == "pytest":  # -v: a line as each test starts and as it ends (run_pytest)
        return [sys.executable, "-m", "pytest", "-m", "gpu", "-n", "auto", "-v", "-rfE", "-p",
                "no:cacheprovider", str(common.REPO / "tests")]
    return common.torchrun_command(config, metrics_path)


def run(config, command, workdir, env, timeout):
    """The runs as they are, pytest's as run_pytest says; T5's, and its --plan, for the peak it
    predicts."""
    if config["kind"] == "pytest":
        return run_pytest(command, workdir, env=env, timeout=min(timeout, PYTEST_LIMIT_S))
    returncode, stdout, stderr, seen = common.run_plain(command, workdir, env=env, timeout=timeout)
    if config["kind"] == "t5":
        plan = subprocess.run([sys.executable, str(common.REPO / config["script"]), "--plan",
                               "--world-size", "1", *config["args"]], cwd=workdir, env=env,
                              capture_output=True, text=True, timeout=300)
        found = re.search(r"predicted peak\s+([\d.]+)\s*\n", plan.stdout)
        unit = 2**30 if "in GiB" in plan.stdout else 2**20
        seen["plan_peak_mib"] = float(found[1]) * unit / common.MIB if found else None
    return returncode, stdout, stderr, seen


def run_pytest(command, workdir, env, timeout):
    """pytest -m gpu -n auto, each test's time (its fixtures included) from the line pytest-xdist
    prints as the test starts on a worker to the one it prints as it ends, taken as they come, so
    that a run stopped at timeout (its process group: the runs it started too) still says where
    its time went. The metrics file the runner reads: the counts of outcomes and the three slowest
    tests. stderr: the failed tests' lines, and where it was stopped."""
    started = time.perf_counter()
    proc = subprocess.Popen(command, cwd=workdir, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    stop = threading.Timer(timeout, os.killpg, args=(proc.pid, signal.SIGTERM))
    stop.start()
    running, seconds, counts = {}, {}, {}

    def seen(line):  # "tests/test_t5.py::test_x " as it starts, and as it ends, on a worker,
        # "[gw3] [ 40%] PASSED tests/test_t5.py::test_x "; each once
        ended = re.match(r"\[gw\d+\] \[\s*\d+%\] (PASSED|FAILED|SKIPPED|ERROR) \S+?::(.+?) $",
                         line)
        if ended and ended[2] not in seconds:
            seconds[ended[2]] = time.perf_counter() - running.pop(ended[2], started)
            counts[ended[1].lower()] = counts.get(ended[1].lower(), 0) + 1
        elif (begun := re.match(r"\S+?::(.+?) $", line)) and begun[1] not in seconds:
            running.setdefault(begun[1], time.perf_counter())

    # pytest ends a line as it begins the next (a worker's next test): a line is judged as it
    # comes, before its newline, and again once whole
    decoder, lines, tail = codecs.getincrementaldecoder("utf-8")(errors="replace"), [], ""
    while chunk := os.read(proc.stdout.fileno(), 1 << 16):
        *whole, tail = (tail + decoder.decode(chunk)).split("\n")
        lines += whole
        for line in [*whole, tail]:
            seen(line)
    returncode = proc.wait()
    stop.cancel()
    stdout = "\n".join([*lines, tail])
    slowest = sorted(seconds.items(), key=lambda item: -item[1])[:3]
    (workdir / "metrics.json").write_text(json.dumps({"device": "cuda", "world_size": 1,
                                                      **counts, "slowest": slowest}))
    stderr = "".join(f"{line}\n" for line in re.findall(r"^(?:FAILED|ERROR) .+$", stdout,
                                                        re.MULTILINE))
    if time.perf_counter() - started >= timeout:  # stopped: the tests that had not ended
        now, selected = time.perf_counter(), re.search(r"\[(\d+) items?\]", stdout)
        stderr += (f"pytest -m gpu stopped at {timeout} s, after {len(seconds)} of "
                   f"{selected[1] if selected else '?'} tests: "
                   + ", ".join(f"{test} {taken:.0f} s" for test, taken in seconds.items())
                   + "; still running: "
                   + (", ".join(f"{test} {now - at:.0f} s" for test, at in running.items())
                      or "none"))
    return returncode, stdout, stderr, {}


def figures(config, metrics, stdout, seen):
    if config["kind"] == "pytest":
        if metrics.get("failed") or metrics.get("error") or metrics.get("errors"):
            raise ValueError(f"pytest -m gpu: {metrics}")
        return {"passed": metrics.get("passed", 0), "skipped": metrics.get("skipped", 0),
                "seconds": seen["seconds"], "slowest": metrics["slowest"]}
    if config["kind"] == "c1b":
        stalls = metrics["checkpoint_stall_s"] or [None]
        return {**common.memory_figures(metrics), "tokens_per_s": metrics["tokens_per_s"],
                "mfu": metrics["mfu"], "first_pause_s": stalls[0],
                "later_pause_s": stalls[1] if len(stalls) > 1 else None}
    found = {**common.memory_figures(metrics), "plan_peak_mib": seen["plan_peak_mib"]}
    found["samples_per_s"] = T5_SAMPLES / common.steady_epoch_time(metrics["epoch_times"])
    found["graphs"] = metrics.get("compiled_graphs_per_epoch") or None
    return found


def tables(ctx, configs):
    card = (f"{torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
            if torch.cuda.is_available() else "no GPU")
    versions = {name: version_of(name) for name in ("transformers", "torchao", "peft")}
    rows = []
    for c in configs:
        if c["kind"] == "pytest":
            said = (f"{fmt(median(c, 'passed'), '.0f')} passed, {fmt(median(c, 'skipped'), '.0f')} "
                    f"skipped in {fmt(median(c, 'seconds'), '.0f')} s")
            if c["figures"]:  # run once: its slowest tests, to size the check by
                said += "; slowest: " + ", ".join(f"{test} {taken:.0f} s"
                                                  for test, taken in c["figures"][0]["slowest"])
        elif c["kind"] == "c1b":
            said = (f"{fmt(median(c, 'tokens_per_s'), ',.0f')} tokens/s, MFU "
                    f"{fmt(median(c, 'mfu'), '.1%')}")
            if median(c, "first_pause_s") is not None:
                said += (f"; pauses: first save {fmt(median(c, 'first_pause_s'), '.2f')} s, later "
                         f"{fmt(median(c, 'later_pause_s'), '.2f')} s")
        else:
            # full fine-tuning's row of the same FSDP version, compiled or not
            full = next((f for f in configs if f["kind"] == "t5" and f["name"].startswith(
                "T5 full") and f["args"][-2:] == c["args"][-2:]), None)
            speed = median(c, "samples_per_s")
            said = (f"{fmt(speed, ',.1f')} samples/s ("
                    f"{fmt(ratio(speed, median(full, 'samples_per_s')), '.2f')}x full); peak "
                    f"{fmt(median(c, 'peak_mib'), ',.0f')} MiB, --plan "
                    f"{fmt(median(c, 'plan_peak_mib'), ',.0f')} MiB")
        rows.append([common.flagged(c["name"], c), said])
    return ["\n### GPU check\n",
            f"{card}; torch {torch.__version__}, "
            + ", ".join(f"{name} {version}" for name, version in versions.items())
            + f"; {repeats_said(ctx.args)}. T5: `{' '.join(lora_gpu.SIZES)}`, {T5_SAMPLES} "
            f"samples, {T5_EPOCHS} epochs, samples/s of the epochs after the first; C1B: "
            f"`{' '.join(fsdp2_gpu.C1B)}`.\n",
            markdown_table(["run", "result"], rows)]


def figures_note(args):
    """The header's word on its figures, which are not --repeats' medians."""
    return f"gpu-check: {repeats_said(args)}."


def repeats_said(args):
    return (f"{common.repeats_said(args.gpu_check_repeats)} per row (--gpu-check-repeats), "
            "pytest -m gpu once")


def version_of(package):
    try:
        from importlib.metadata import version
        return version(package)
    except Exception:  # not installed
        return "not installed"
