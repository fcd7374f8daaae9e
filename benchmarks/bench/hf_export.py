"""hf-export: each rank's memory while FSDP2 exports the merged model (world sizes 2 and 4, CPU).

hf-load's model stored in the first of --hf-load-dtypes, LoRA, one epoch, then the export of the
merged model: shard by shard (DCP's HF writer, in files of a quarter of the model) and gathered
on rank 0 (--full-state-dict, today's way). Each rank's RssAnon from the line before the export
until its `Saved` line, above what the rank held as the export began (glibc made to return freed
memory: hf_memory.RETURN_FREED). --hf-load-repeats runs per configuration.
"""
from hf_memory import RETURN_FREED, rss_anon_peaks  # benchmarks/, beside run.py

from . import common, hf_load, t5
from .common import flagged, fmt, markdown_table, median, ratio

NAME, ORDER = "hf-export", 100
FIXTURES = {"hf"}
# hf-load's run with validation and saving, so that epoch 1 exports its model.
RUN = [flag for flag in hf_load.RUN if flag not in ("--no-save-model", "--no-run-validation")]
WAYS = {"shard by shard (files of a quarter of the model)": [],
        "gathered on rank 0 (--full-state-dict)": ["--full-state-dict"]}
FROM, UNTIL = "New Val Loss Record", "Saved "


def runs(ctx):
    """CPU; the model stored in the first dtype, as safetensors."""
    model = hf_load.model_dir(ctx, ctx.args.hf_load_dtypes[0], "shard by shard")
    return [{"device": "cpu", "world_size": world_size, "name": way, "way": way,
             "repeats": ctx.args.hf_load_repeats, "script": "t5_fsdp_finetune.py",
             "args": ["--model-name", str(model), "--data-dir", str(ctx.hf_data), *RUN, *flags]}
            for world_size in hf_load.WORLD_SIZES for way, flags in WAYS.items()]


def run(config, command, workdir, env, timeout):
    """Each rank's RssAnon from the line before the export until the export's last line."""
    returncode, stdout, stderr, peaks, saved, bases = rss_anon_peaks(
        command, workdir, UNTIL, env={**env, **RETURN_FREED}, timeout=timeout, start=FROM)
    return returncode, stdout, stderr, {"peaks": peaks, "saved": saved, "bases": bases}


def figures(config, metrics, stdout, seen):
    found = t5.figures(config, metrics=metrics, stdout=stdout, seen=seen)
    peaks, bases = seen["peaks"], seen["bases"]
    if not seen["saved"] or sorted(bases) != list(range(config["world_size"])):
        raise ValueError(f"no {UNTIL!r} line, or ranks unsampled")
    return {**found, **{f"rank{rank}_mib": (peaks[rank] - base) / common.MIB
                        for rank, base in sorted(bases.items())}}


def tables(ctx, configs):
    args, parameters = ctx.args, ctx.hf_parameters
    model_mib = 4 * parameters / common.MIB if parameters else None  # fp32, as the script trains
    headers = ["world size", "way", "RssAnon added while exporting, per rank (MiB)",
               "per rank, in models", "max, in models",
               f"target: model / N + {hf_load.TARGET:.0%} of it, in models", "within target"]
    rows = []
    for c in configs:
        added = [median(c, f"rank{rank}_mib") for rank in range(c["world_size"])]
        most = None if None in added else max(added)
        target = model_mib * (1 / c["world_size"] + hf_load.TARGET) if model_mib else None
        rows.append([c["world_size"], flagged(c["way"], c),
                     " / ".join(fmt(a, ".0f") for a in added),
                     " / ".join(fmt(ratio(a, model_mib), ".2f") for a in added),
                     fmt(ratio(most, model_mib), ".2f"), fmt(ratio(target, model_mib), ".2f"),
                     hf_load.within_target(most, target)])
    return ["\n### T5 at t5-base's shape: each rank's memory while FSDP2 exports it (CPU, gloo)\n",
            f"The hf-load table's model ({fmt(model_mib, ',.0f')} MiB in fp32: the model), stored "
            f"in {args.hf_load_dtypes[0]} as safetensors, `{' '.join(RUN)}`: after one "
            "epoch the merged model is exported (fp32 files). Each rank's RssAnon from the line "
            f"{FROM!r} until {UNTIL!r}, less what it held at the first; "
            f"{hf_load.repeats_said(args)}.\n",
            markdown_table(headers, rows)]
