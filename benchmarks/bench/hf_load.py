"""hf-load: each rank's memory while --cpu-ram-efficient-loading loads a t5-base-shaped T5 (world
sizes 2 and 4, CPU: 10 minutes on 2 busy cores).

The model is stored in bf16 and fp32 (--hf-load-dtypes), each as safetensors and as a
pytorch_model.bin; FSDP2 with --cpu-ram-efficient-loading and LoRA reads it shard by shard from
the safetensors (the new way), or from rank 0 from the .bin (today's way). Each rank's peak
anonymous memory (RssAnon, sampled every 10 ms by benchmarks/hf_memory.py) until the model is
sharded, above the tests' tiny T5's, against the target (model / world size) + 25% of the model.
One run per configuration (--hf-load-repeats).
"""
from hf_memory import rss_anon_peaks  # benchmarks/, beside run.py

from . import common, lora, t5
from .common import find, flagged, fmt, markdown_table, median, ratio

NAME, ORDER = "hf-load", 90
FIXTURES = {"hf"}
WORLD_SIZES = (2, 4)
# way: the file the model is read from (the hf fixture's folder of that format)
WAYS = {"shard by shard": "safetensors", "from rank 0": "pytorch_model.bin"}
# with LoRA, so that the training state is small
RUN = ["--fsdp-version", "2", "--cpu-ram-efficient-loading", *lora.LORA, "--cpu",
       "--input-length", "32", "--output-length", "16", "--num-train-samples", "4",
       "--num-val-samples", "4", "--epochs", "1", "--batch-size", "1", "--no-save-model",
       "--no-run-validation"]
UNTIL = "FSDP2 sharded"  # each rank's peak until the script prints it (sharded and loaded)
FROM_RANK0 = "--cpu-ram-efficient-loading: the model has no safetensors files"
TARGET = 0.25  # the issue's: each rank at most (model / world size) + 25% of the model


def add_flags(group):
    group.add_argument("--hf-load-repeats", type=int, default=1, metavar="N",
                       help="hf-load: runs per configuration, the median taken (its memory does "
                            "not vary as times do; --repeats is for the others)")


def check(args, asked, error):
    common.at_least_one(args, error, "hf_load_repeats")


def model_dir(ctx, dtype, way):
    """The hf fixture's folder of the model stored in dtype, in the file way reads."""
    return ctx.hf_models[(dtype, WAYS[way].split(".")[-1])]


def runs(ctx):
    """CPU; per world size the tiny T5 (the baseline), then the model's rows."""
    configs = []
    for world_size in WORLD_SIZES:
        rows = [("tiny", "shard by shard", ctx.hf_tiny)] + [
            (dtype, way, model_dir(ctx, dtype, way)) for dtype in ctx.args.hf_load_dtypes
            for way in WAYS]
        configs += [{"device": "cpu", "world_size": world_size,
                     "name": (f"tiny T5 (baseline), {way}" if dtype == "tiny" else
                              f"t5-base's shape stored in {dtype}, {way}"),
                     "dtype": dtype, "way": way, "repeats": ctx.args.hf_load_repeats,
                     "script": "t5_fsdp_finetune.py",
                     "args": ["--model-name", str(folder), "--data-dir", str(ctx.hf_data), *RUN]}
                    for dtype, way, folder in rows]
    return configs


def run(config, command, workdir, env, timeout):
    """RssAnon of each rank, sampled every 10 ms until the model is loaded and sharded."""
    returncode, stdout, stderr, peaks, loaded, _ = rss_anon_peaks(command, workdir, UNTIL,
                                                                  env=env, timeout=timeout)
    return returncode, stdout, stderr, {"peaks": peaks, "loaded": loaded}


def figures(config, metrics, stdout, seen):
    """Each rank's peak RssAnon (MiB) until the model was sharded and loaded. Raises ValueError
    when the run did not get there, or loaded another way."""
    found = t5.figures(config, metrics=metrics, stdout=stdout, seen=seen)
    peaks = seen["peaks"]
    if not seen["loaded"]:
        raise ValueError(f"its output never said {UNTIL!r}")
    if sorted(peaks) != list(range(config["world_size"])):
        raise ValueError(f"RssAnon was sampled for ranks {sorted(peaks)}, not for each of "
                         f"{config['world_size']}")
    way = "from rank 0" if FROM_RANK0 in stdout else "shard by shard"
    if way != config["way"]:
        raise ValueError(f"it loaded {way}, not {config['way']}")
    return {**found, **{f"rank{rank}_mib": peak / common.MIB
                        for rank, peak in sorted(peaks.items())}}


def figures_note(args):
    return (f"hf-load: {args.hf_load_repeats} run{'s' if args.hf_load_repeats > 1 else ''}"
            " per configuration (--hf-load-repeats), each rank's memory shown.")


def repeats_said(args):
    """How many runs its figures are the median of (hf-export's too)."""
    return common.repeats_said(args.hf_load_repeats) + " per configuration"


def tables(ctx, configs):
    args, parameters = ctx.args, ctx.hf_parameters
    model_mib = 4 * parameters / common.MIB if parameters else None  # fp32, as the script trains
    headers = ["world size", "stored in", "way", "peak RssAnon above the tiny T5's, per rank "
               "(MiB)", "per rank, in models", "max over ranks (MiB)", "max, in models",
               f"target: model / N + {TARGET:.0%} of it (MiB)", "target, in models",
               "within target"]
    rows, tiny_said, within = [], [], {}  # (dtype, way) -> [(within, max in models)]
    for c in configs:
        ranks = [f"rank{rank}_mib" for rank in range(c["world_size"])]
        tiny = find(configs, world_size=c["world_size"], dtype="tiny")
        if c is tiny:
            tiny_said.append(flagged(f"{c['world_size']} ranks "
                                     + " / ".join(fmt(median(c, key), ".0f") for key in ranks),
                                     c))
            continue
        above = [None if median(c, key) is None or median(tiny, key) is None
                 else median(c, key) - median(tiny, key) for key in ranks]
        most = None if None in above else max(above)
        target = model_mib * (1 / c["world_size"] + TARGET) if model_mib else None
        if most is not None and target:
            within.setdefault((c["dtype"], c["way"]), []).append((most <= target,
                                                                  most / model_mib))
        rows.append([c["world_size"], flagged(c["dtype"], c), c["way"] + f" ({WAYS[c['way']]})",
                     " / ".join(fmt(a, ".0f") for a in above),
                     " / ".join(fmt(ratio(a, model_mib), ".2f") for a in above),
                     fmt(most, ".0f"), fmt(ratio(most, model_mib), ".2f"), fmt(target, ".0f"),
                     fmt(ratio(target, model_mib), ".2f"), within_target(most, target)])
    summary = []
    for (dtype, way), results in within.items():
        grew = sorted({f"{fraction:.2f}" for _, fraction in results}, key=float)
        summary.append(f"stored in {dtype}, {way}, the rank that grew most grew by "
                       f"{'-'.join(grew[::len(grew) - 1] if len(grew) > 1 else grew)} of the "
                       f"model, within the target at {sum(ok for ok, _ in results)} of "
                       f"{len(results)} world sizes")
    return ["\n### T5 at t5-base's shape: each rank's memory while --cpu-ram-efficient-loading "
            "loads it (CPU, gloo)\n",
            f"Model: t5-base's shape with random weights ({fmt(parameters, ',')} parameters, "
            f"{fmt(model_mib, ',.0f')} MiB in fp32: the model, below; written by "
            "tests/tiny_wikihow.py's write_tiny_t5), stored in "
            f"{' and '.join(args.hf_load_dtypes)} by benchmarks/hf_memory.py, once as safetensors "
            "(the new way: each rank reads its shards with DCP's HuggingFaceStorageReader) and "
            "once as a pytorch_model.bin (today's way, the fallback: rank 0 loads the whole model "
            "and broadcasts each rank's shards). "
            f"`{' '.join(RUN)}`, data the WikiHow-format fixture CSV of the tests; "
            f"{repeats_said(args)}. Each rank's RssAnon (anonymous memory: not the page cache of "
            "memory-mapped files) is sampled every 10 ms from the start until the script prints "
            f"'{UNTIL}' (loaded and sharded); the table gives its peak less the same "
            "rank's with the tests' tiny T5 (write_tiny_t5's defaults, same flags: "
            f"{'; '.join(tiny_said)} MiB), and as a fraction of the model (fp32, as the script "
            f"trains). The target is the issue's: at most (model / world size) + {TARGET:.0%} of "
            "the model on every rank.\n",
            markdown_table(headers, rows),
            "\n" + ("What it shows: " + "; ".join(summary) + "." if summary else
                    "What it shows: nothing, no configuration was measured against its baseline.")]


def within_target(most, target):
    """The last column: whether the rank that grew most stayed within the target (hf-export's
    too)."""
    return "n/a" if most is None or not target else "yes" if most <= target else "no"
