"""The benchmarks of benchmarks/run.py, one module each.

benchmarks/run.py knows none of them by name: it imports every module of this package that has a
NAME (load(), below), and asks each what to run and how to show it. Adding a benchmark is adding
a module here; a benchmark's runs, figures and tables are all in its own file.

What a benchmark module defines (the runner reads nothing else of it):

    NAME         the name --only takes, e.g. "lora-gpu"
    ORDER        where it comes among the others: in --only's list, in the order the runs are
                 built and run, and in the tables (ascending)
  and where they are not False or empty (load() gives these defaults to a module without):
    DEFAULT      True: one of the benchmarks run when --only is not given
    PER_DEVICE   True: its runs and tables are made once for the CPU and once more for the GPU
                 when one is used; runs(ctx, device) and tables(ctx, configs, device) then take
                 the device ("cpu" or "cuda"). These benchmarks come first, device by device.
    TAKES_TURNS  True: its configurations take turns (each runs once, then each again), so that
                 the machine's drift touches every row alike; otherwise each configuration's
                 runs follow one another
    FIXTURES     the shared fixtures it reads (a set of "mnist", "t5", "lora", "hf"):
                 bench/fixtures.py writes each once, whichever benchmarks ask for it

    add_flags(group)               (optional) its own command-line flags, into an argparse
                                   group of its own
    check(args, asked, error)      (optional) its flags' values, whether it runs or not, and,
                                   when asked (it runs), its refusals (no GPU, a package
                                   missing): error(message) exits
    runs(ctx)                      its configurations, one dict per table row: "name",
                                   "script" (from the repository root, or absolute), "args",
                                   "world_size", "device"; optionally "repeats" (instead of
                                   --repeats), "metrics_file" (the file to read instead of
                                   metrics.json) and "metrics_world_size" (the world size the
                                   metrics say, where it is not the processes started). Any
                                   other key is its own, for its figures and tables. The
                                   runner adds "benchmark", "figures" and "failed".
    command(config, metrics_path)  (optional) the command of a run, where it is not
                                   common.torchrun_command's
    prepare(ctx)                   (optional) work before the runs (lora: --plan). With
                                   --dry-run it does nothing and returns the commands it would
                                   run, which are printed after the runs' commands.
    run(config, command, workdir, env, timeout)
                                   (optional) a run that is more than running the command
                                   (memory sampled, a rank killed): returns (returncode,
                                   stdout, stderr, seen), seen a dict of what it saw
    figures(config, metrics, stdout, seen)
                                   the figures of a run that exited 0 and whose metrics file
                                   says the configuration's device and world size (the runner
                                   checks both), in the tables' units, from its metrics file,
                                   its output and what run() saw (with the runner's "cpu_s"
                                   and "seconds" added). Raises KeyError for a figure missing
                                   from the metrics, ValueError for a run that did not do what
                                   it should: the run then counts as FAILED.
    tables(ctx, configs)           its markdown: a list of pieces (title, caption, table), from
                                   its configurations, each with "figures" (one dict per
                                   successful run) and "failed"; common.median reads them
    figures_note(args)             (optional) a sentence for the header about how many runs its
                                   figures are the median of, where that is not --repeats; when
                                   every benchmark asked has one, it replaces the general one

ctx, the run's shared state (a SimpleNamespace): args (every flag), tmp (the temporary folder,
removed at the end), env (the runs' environment), cores, gpu (whether a CUDA GPU is used),
devices, notes (sentences said under the header), failures (runs that failed: a picture that
fails may add itself), the fixtures' paths and captions (bench/fixtures.py), and whatever a
benchmark keeps there between its prepare() and its tables() (lora: ctx.lora_plans).
"""
import importlib
import pkgutil

DEFAULTS = {"DEFAULT": False, "PER_DEVICE": False, "TAKES_TURNS": False, "FIXTURES": frozenset()}


def load():
    """The benchmark modules of this package (those with a NAME), in their ORDER, each with the
    DEFAULTS of what it does not set."""
    modules = [importlib.import_module(f"{__name__}.{info.name}")
               for info in pkgutil.iter_modules(__path__)]
    benchmarks = sorted((module for module in modules if hasattr(module, "NAME")),
                        key=lambda module: module.ORDER)
    for benchmark in benchmarks:
        for attribute, value in DEFAULTS.items():
            if not hasattr(benchmark, attribute):
                setattr(benchmark, attribute, value)
    return benchmarks
