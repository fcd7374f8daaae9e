"""generation: --rouge's summaries generated at t5-base's shape on 2 CPU ranks, the parameters
gathered once (--generate gathered: a whole copy of the model on each rank) against block by
block (--generate by-block: each block's all-gathered in each of its forwards, at every token),
under FSDP1 and FSDP2: seconds per summary and each rank's memory while generating.

The lora benchmark's model (t5-base's shape, random weights) and data; one epoch of 2 training
articles, then the 8 validation articles' summaries, 4 per rank in one batch, greedy, each of the
most new tokens (no_eos_model). Each rank's RssAnon from the training loss's line until the ROUGE
line, less what it held at the first (hf_memory, glibc made to return freed memory).
"""
import json
import os
from pathlib import Path

from hf_memory import RETURN_FREED, rss_anon_peaks  # benchmarks/, beside run.py

from . import common, lora
from .common import find, flagged, fmt, markdown_table, median, ratio, runs_said

NAME, ORDER = "generation", 75
TAKES_TURNS = True
FIXTURES = {"lora"}
ARTICLES = 8
RUN = ["--num-train-samples", "2", "--num-val-samples", str(ARTICLES), "--test-batch-size", "4",
       "--epochs", "1", "--no-save-model", "--rouge", "--generation-max-length", "24"]
WAYS = {"gathered once": ["--generate", "gathered"], "block by block": ["--generate", "by-block"]}
FROM, UNTIL = "Train Epoch: ", "ROUGE-1 "  # generation follows training
TARGET = 2.0  # gathered once at least this many times faster (issue 61)


def no_eos_model(ctx):
    """The lora fixture's model (its files linked) with a generation config that names no </s>:
    random weights write it within a few tokens, and the summaries would be too short to show the
    cost of each token; without it each runs to --generation-max-length. A --lora-model that is
    not a local folder (a hub id: a trained model) is used as it is."""
    source, folder = Path(str(ctx.lora_model)), ctx.tmp / "t5-base-shape-no-eos"
    if ctx.args.dry_run or folder.exists() or not source.is_dir():
        return folder if ctx.args.dry_run or folder.exists() else source
    folder.mkdir()
    for path in source.iterdir():
        if path.name != "generation_config.json":
            os.symlink(path.resolve(), folder / path.name)
    config = json.loads((source / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": None}))
    return folder


def runs(ctx):
    model = no_eos_model(ctx)
    return [{"device": "cpu", "world_size": 2, "name": f"{way}, FSDP{version}", "way": way,
             "fsdp_version": version, "script": "t5_fsdp_finetune.py",
             "args": ["--model-name", str(model), "--data-dir", str(ctx.lora_data),
                      *lora.SIZES, *RUN, *flags, "--fsdp-version", str(version)]}
            for version in (1, 2) for way, flags in WAYS.items()]


def run(config, command, workdir, env, timeout):
    """Each rank's RssAnon from the training loss's line until the ROUGE line."""
    returncode, stdout, stderr, peaks, saved, bases = rss_anon_peaks(
        command, workdir, UNTIL, env={**env, **RETURN_FREED}, timeout=timeout, start=FROM)
    return returncode, stdout, stderr, {"peaks": peaks, "seen": saved, "bases": bases}


def figures(config, metrics, stdout, seen):
    generated = metrics["rouge"]
    if not seen["seen"] or sorted(seen["bases"]) != [0, 1]:
        raise ValueError(f"no {UNTIL!r} line, or ranks unsampled")
    return {"s_per_summary": generated["seconds_per_summary"],
            **{f"rank{rank}_mib": (seen["peaks"][rank] - base) / common.MIB
               for rank, base in seen["bases"].items()}}


def tables(ctx, configs):
    headers = ["FSDP", "parameters", "s / summary", "gathered once: x faster",
               f"target: >= {TARGET:.0f}x", "memory added while generating, per rank (MiB)"]
    rows = []
    for c in configs:
        by_block = find(configs, way="block by block", fsdp_version=c["fsdp_version"])
        faster = ratio(median(by_block, "s_per_summary"), median(c, "s_per_summary"))
        gathered = c["way"] == "gathered once"
        rows.append([c["fsdp_version"], flagged(c["way"], c), fmt(median(c, "s_per_summary"),
                                                                   ".3f"),
                     fmt(faster, ".2f") if gathered else "",
                     ("yes" if faster >= TARGET else "no") if gathered and faster else "",
                     " / ".join(fmt(median(c, f"rank{rank}_mib"), ".0f") for rank in (0, 1))])
    return ["\n### T5: generating summaries under FSDP, gathered once or block by block (CPU)\n",
            f"{ctx.lora_source}. World size 2, `{' '.join(lora.SIZES)} {' '.join(RUN)}`: after "
            f"one epoch, {ARTICLES} summaries (4 per rank, one batch each), each of 24 tokens "
            "(the model's generation config names no </s>). Seconds per summary: the "
            f"generation's wall time / {ARTICLES} (metrics' rouge.seconds_per_summary, the "
            "gathering included). Memory: "
            f"each rank's RssAnon from the line {FROM!r} until {UNTIL!r}, less what it held at "
            f"the first; {runs_said(ctx.args)}, the configurations taking turns.\n",
            markdown_table(headers, rows)]
