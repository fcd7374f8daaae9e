"""Benchmark every script and option: memory per rank, time and throughput, as markdown tables.

Runs the real scripts under torch.distributed.run, each configuration --repeats times (default 3),
and prints one markdown table per benchmark in which every figure is the median over those runs:

    python benchmarks/run.py                                # all three benchmarks, 3 runs each
    python benchmarks/run.py --only fsdp2 t5 --out bench.md --raw-json bench-runs.json
    python benchmarks/run.py --only mnist --mnist-dir data  # real MNIST, not the digits fixture
    python benchmarks/run.py --only t5 --wikihow-dir data --t5-model t5-base-local
    python benchmarks/run.py --smoke --repeats 1 --only fsdp2 --fsdp2-steps 10  # not for quoting
    python benchmarks/run.py --only fsdp2-gpu      # C1B (1B parameters) on one GPU
    python benchmarks/run.py --only checkpoint --thread-writer-script old/fsdp2_transformer.py
    python benchmarks/run.py --only tp             # (dp, tp) = (4, 1), (2, 2), (1, 4) on CPU
    python benchmarks/run.py --only lora --lora-plot benchmarks/t5_memory.png  # 33 min, 2 cores
    python benchmarks/run.py --only lora --dry-run     # the commands it would run; runs nothing
    python benchmarks/run.py --only lora-gpu           # the same rows on one GPU, bf16 compute
    python benchmarks/run.py --only hf-load --out hf_load.md  # RssAnon while loading, 10 min
    python benchmarks/run.py --only hf-export          # RssAnon while FSDP2 exports, 2 and 4 ranks
    python benchmarks/run.py --only cpu-memory         # freed memory returned, or kept by glibc
    python benchmarks/run.py --only lengths --repeats 2  # token batches, packed documents; 2 cores
    python benchmarks/run.py --only fault-tolerance    # a rank killed: torchft vs a full restart

Without --mnist-dir, --wikihow-dir or --t5-model, the offline fixtures of the tests are written
into a temporary directory first (tests/digits_mnist.py needs scikit-learn), and the tables say so.

Each benchmark is a module of benchmarks/bench/: its docstring says what it measures (so does
--help), and the module holds its runs, its figures and its tables. This file knows none of them
by name: it parses the flags, writes the fixtures they share (bench/fixtures.py), runs every
configuration (the benchmarks that take turns first, each configuration once, then again), takes
the medians and prints the tables. bench/__init__.py describes what a benchmark module defines.
With a CUDA GPU, mnist, fsdp2 and t5 run again at world size 1 on the GPU (--no-gpu: not).

A failed run prints its command and the end of its stderr at once; its configuration reads FAILED
in the table, and the harness exits with status 1 after printing the tables. benchmarks/README.md
says what every column means.
"""
import argparse
import json
import os
import platform
import re
import resource
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import bench
import torch
from bench import fixtures
from bench.common import log, run_plain, runs_said, stderr_tail, torchrun_command


def parse_args(benchmarks, argv=None):
    """The common flags, the fixtures' and each benchmark's own (a group each, with what it
    measures); then every benchmark's check of its flags, and the refusals of those asked."""
    names = [benchmark.NAME for benchmark in benchmarks]
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--only", nargs="+", choices=names,
        default=[benchmark.NAME for benchmark in benchmarks if benchmark.DEFAULT],
        metavar="NAME", help=f"benchmarks to run, any of {', '.join(names)} (those not run by "
        "default only when asked for; each is described below, with its own flags)")
    add("--repeats", type=int, default=3, metavar="N",
        help="runs per configuration; every figure is the median over them "
             "(at least 3 without --smoke)")
    add("--smoke", action="store_true",
        help="allow --repeats below 3, to check that the harness works; the tables say so")
    add("--out", default=None, metavar="FILE",
        help="also write the markdown to FILE, after every run (the tables so far, marked "
             "partial: a harness stopped early keeps what it measured) and at the end")
    add("--raw-json", default=None, metavar="FILE",
        help="write every run (command, metrics JSON, the figures taken from it) to FILE, after "
             "every run and at the end")
    add("--no-gpu", action="store_true",
        help="skip the GPU runs even when a CUDA GPU is visible")
    add("--timeout", type=int, default=900, metavar="S",
        help="seconds before a run counts as failed")
    add("--dry-run", action="store_true",
        help="print every run's command and exit, running nothing (lora, hf-load: not even "
             "writing the 198M model; lora: nor running --plan)")
    fixtures.add_flags(parser.add_argument_group(
        "data and models", "the benchmarks' own instead of the tests' fixtures"))
    for benchmark in benchmarks:
        what = " ".join(benchmark.__doc__.split("\n\n")[0].split())
        group = parser.add_argument_group(benchmark.NAME, what.removeprefix(f"{benchmark.NAME}: "))
        if hasattr(benchmark, "add_flags"):
            benchmark.add_flags(group)
    args = parser.parse_args(argv)
    if args.repeats < 3 and not args.smoke:
        parser.error(f"--repeats {args.repeats}: a median needs at least 3 runs; "
                     "pass --smoke to run fewer anyway")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    if args.timeout < 1:
        parser.error("--timeout must be at least 1")
    for benchmark in benchmarks:
        if hasattr(benchmark, "check"):
            benchmark.check(args, asked=benchmark.NAME in args.only, error=parser.error)
    return args


def shared_state(args):
    """ctx: what the runner and the benchmarks share for this run (bench/__init__.py)."""
    gpu = torch.cuda.is_available() and not args.no_gpu
    return SimpleNamespace(args=args, cores=os.cpu_count() or 1, gpu=gpu,
                           devices=["cpu"] + (["cuda"] if gpu else []), notes=[], failures=[],
                           tmp=Path(tempfile.mkdtemp(prefix="fsdp-bench-")), env=dict(os.environ))


def configurations(ctx, asked):
    """One dict per table row, in the order they are built and run: the benchmarks that run on
    every device first, device by device, then the others."""
    configs = []
    for device in ctx.devices:
        for benchmark in (b for b in asked if b.PER_DEVICE):
            configs += [{**config, "benchmark": benchmark.NAME}
                        for config in benchmark.runs(ctx, device)]
    for benchmark in (b for b in asked if not b.PER_DEVICE):
        configs += [{**config, "benchmark": benchmark.NAME} for config in benchmark.runs(ctx)]
    return configs


def command_of(benchmark, config, metrics_path):
    if hasattr(benchmark, "command"):
        return benchmark.command(config, metrics_path)
    return torchrun_command(config, metrics_path)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            names = re.findall(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        if names:
            return names[0].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_seconds_of_children():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_all(ctx, by_name, configs, after_each):
    """Every configuration's runs: those of the benchmarks that take turns first (each
    configuration once, then again), then the others, each configuration's runs in a row. A
    configuration whose run failed runs no more. after_each(runs so far, runs planned) follows
    every run. Returns every run's record."""
    for config in configs:
        config["figures"], config["failed"] = [], False  # one dict per successful run
        config.setdefault("repeats", ctx.args.repeats)  # hf-load's: --hf-load-repeats
    total = sum(config["repeats"] for config in configs)
    turns = {config["benchmark"]: by_name[config["benchmark"]].TAKES_TURNS for config in configs}
    schedule = [(config, repeat) for repeat in range(1, ctx.args.repeats + 1) for config in configs
                if turns[config["benchmark"]]]
    schedule += [(config, repeat) for config in configs if not turns[config["benchmark"]]
                 for repeat in range(1, config["repeats"] + 1)]
    runs = []
    for config, repeat in schedule:
        if not config["failed"]:
            log(f"[{len(runs) + 1}/{total}] {label(config)}, run {repeat}/{config['repeats']}")
            runs.append(run_once(ctx, by_name[config["benchmark"]], config, repeat=repeat))
            after_each(runs, total)
    return runs


def label(config):
    return (f"{config['benchmark']} {config['device']} world size {config['world_size']} "
            f"{config['name']}")


def run_once(ctx, benchmark, config, repeat):
    """One run of config, in a folder of its own, and its figures (benchmark.figures): on
    success into config["figures"], else config fails, said at once. Returns the run's record."""
    workdir = Path(tempfile.mkdtemp(prefix="run-", dir=ctx.tmp))  # whatever the script writes
    command = command_of(benchmark, config, workdir / "metrics.json")
    started, cpu_start = time.perf_counter(), cpu_seconds_of_children()
    if hasattr(benchmark, "run"):
        returncode, stdout, stderr, seen = benchmark.run(config, command, workdir, env=ctx.env,
                                                         timeout=ctx.args.timeout)
    else:
        returncode, stdout, stderr, seen = run_plain(command, workdir, env=ctx.env,
                                                     timeout=ctx.args.timeout)
    run = {"benchmark": config["benchmark"], "device": config["device"],
           "world_size": config["world_size"], "name": config["name"], "repeat": repeat,
           "command": command, "returncode": returncode,
           "seconds": time.perf_counter() - started, "metrics": None, "figures": None,
           # every process of the run, reaped ones (torchrun waits for its workers, each
           # worker for its writer): user + system
           "cpu_s": cpu_seconds_of_children() - cpu_start}
    seen = {**seen, "cpu_s": run["cpu_s"], "seconds": run["seconds"]}
    metrics_path = workdir / config.get("metrics_file", "metrics.json")
    error = None
    if returncode != 0 or not metrics_path.exists():
        error = f"exit status {returncode}" + ("" if returncode else " but no metrics file")
    else:
        metrics = run["metrics"] = json.loads(metrics_path.read_text())
        # A script that fell back to another device would put its figures in the wrong table.
        ran_on = (metrics.get("device"), metrics.get("world_size"))
        if ran_on != (config["device"], config.get("metrics_world_size", config["world_size"])):
            error = (f"it ran on {ran_on[0]} at world size {ran_on[1]}, "
                     f"not on {config['device']} at world size {config['world_size']}")
        else:
            try:
                run["figures"] = benchmark.figures(config, metrics=metrics, stdout=stdout,
                                                   seen=seen)
            except KeyError as e:
                error = f"its metrics file has no {e} (has the script changed?)"
            except ValueError as e:
                error = str(e)
    if error:
        run["error"], run["stderr_tail"] = error, stderr_tail(stderr)
        ctx.failures.append(run)
        log(f"\nFAILED: {label(config)}, run {repeat}/{config['repeats']}, {error}\n"
            f"command: {shlex.join(command)}\n"
            f"--- end of its stderr ---\n{run['stderr_tail']}\n"
            "--- the remaining runs of this configuration are skipped ---\n")
        config["failed"] = True
        return run
    config["figures"].append(run["figures"])
    shutil.rmtree(workdir)  # C1B's checkpoints (37.5 GB a run) would fill the disk by the next
    log(f"    {run['seconds']:.1f} s: "
        + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                    for k, v in run["figures"].items()))
    return run


def machine_said(ctx):
    return (f"{cpu_model()}, {ctx.cores} CPU cores, {platform.system()} {platform.machine()}, "
            f"Python {platform.python_version()}, torch {torch.__version__}"
            + (f", GPU: {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})" if ctx.gpu
               else ", no GPU used"))


def report(ctx, asked, configs, runs, elapsed, planned=None):
    """The markdown: the header (machine, command, what a figure is, ctx.notes), then each
    benchmark's tables, in the order of the runs, and the total time; with planned (the number of
    runs), a partial report of the runs so far, which says so."""
    args = ctx.args
    threads = (f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}"
               if "OMP_NUM_THREADS" in os.environ
               else "OMP_NUM_THREADS unset (torchrun sets 1 per process when it starts more than "
                    "one; one process uses every core)")
    out = []
    if planned:
        out.append(f"**Partial: {len(runs)} of {planned} runs so far** (n/a: not run yet; this "
                   "file is rewritten after every run, and once more at the end).")
    out += [f"Measured on: {machine_said(ctx)}; {threads}.",
            f"Command: `{shlex.join(['python', 'benchmarks/run.py', *sys.argv[1:]])}`.",
            f"Every figure is the {runs_said(args)} of the configuration. Epoch time: per run, "
            "the median of the epochs after the first; then the median over runs. Memory per "
            "rank is the maximum over ranks."]
    own = [b.figures_note(args) for b in asked if hasattr(b, "figures_note")]
    if own:  # benchmarks that count their runs otherwise
        out[-1] = " ".join(own if len(own) == len(asked) else [out[-1], *own])
    out += ctx.notes
    for device in ctx.devices:
        for benchmark in (b for b in asked if b.PER_DEVICE):
            out += benchmark.tables(ctx, [c for c in configs if c["benchmark"] == benchmark.NAME
                                          and c["device"] == device], device)
    for benchmark in (b for b in asked if not b.PER_DEVICE):
        out += benchmark.tables(ctx, [c for c in configs if c["benchmark"] == benchmark.NAME])
    failures = ctx.failures
    out.append(f"\nTotal wall time: {elapsed() / 60:.1f} min for {len(runs)} runs"
               f"{f', {len(failures)} FAILED' if failures else ''}.")
    return "\n".join(out) + "\n"


def main():
    benchmarks = bench.load()
    args = parse_args(benchmarks)
    started = time.perf_counter()
    asked = [b for b in benchmarks if b.NAME in args.only]
    ctx = shared_state(args)
    fixtures.write(ctx, set().union(*(b.FIXTURES for b in asked)))
    configs = configurations(ctx, asked)
    by_name = {b.NAME: b for b in benchmarks}
    if args.dry_run:
        for config in configs:
            print(shlex.join(command_of(by_name[config["benchmark"]], config, "metrics.json")))
        for benchmark in (b for b in asked if hasattr(b, "prepare")):
            for line in benchmark.prepare(ctx):  # what it would run before the runs
                print(line)
        shutil.rmtree(ctx.tmp, ignore_errors=True)
        sys.exit(0)
    for benchmark in (b for b in asked if hasattr(b, "prepare")):
        benchmark.prepare(ctx)

    def write(runs, planned=None):
        """--out and --raw-json: after every run (planned: how many), so that a run stopped by a
        time limit (a lent GPU's) keeps the figures of the runs it finished, then at the end."""
        markdown = report(ctx, asked, configs=configs, runs=runs, planned=planned,
                          elapsed=lambda: time.perf_counter() - started)
        if args.out:
            Path(args.out).write_text(markdown)
        if args.raw_json:
            Path(args.raw_json).write_text(json.dumps({"machine": machine_said(ctx),
                                                       "settings": vars(args), "runs": runs},
                                                      indent=2, default=str))
        return markdown

    runs = run_all(ctx, by_name, configs, after_each=write)
    print(write(runs))
    shutil.rmtree(ctx.tmp, ignore_errors=True)  # the fixtures and what the runs wrote
    if ctx.failures:
        log(f"{len(ctx.failures)} run(s) FAILED (their stderr is shown above):")
        for run in ctx.failures:
            log(f"  {run['benchmark']} {run['device']} world size {run['world_size']} "
                f"{run['name']}, run {run['repeat']}: {run['error']}")
        sys.exit(1)


if __name__ == "__main__":
    main()
