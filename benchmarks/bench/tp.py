"""tp: tensor parallel (world size 4, CPU): FSDP2's default model as (dp, tp) = (4, 1), (2, 2) and
(1, 4) with --tp-degree; tokens/s and training state per rank. --fsdp2-steps sets its steps."""
from . import common, fsdp2
from .common import find, flagged, fmt, markdown_table, median, ratio, runs_said

NAME, ORDER = "tp", 40
DEGREES = (1, 2, 4)
WORLD_SIZE = 4


def runs(ctx):
    if ctx.cores < WORLD_SIZE:
        ctx.notes.append(f"Tensor parallel on 4 ranks with {ctx.cores} CPU cores: the processes "
                         "share the cores, so tokens/s compares the layouts, not what 4 cores "
                         "would do.")
    return [{"device": "cpu", "world_size": WORLD_SIZE, "tp": tp,
             "name": f"dp {WORLD_SIZE // tp} x tp {tp}", "script": "fsdp2_transformer.py",
             "args": [*fsdp2.steps_args(ctx.args), "--tp-degree", str(tp), "--cpu"]}
            for tp in DEGREES]


figures = fsdp2.figures


def tables(ctx, configs):
    fsdp = find(configs, tp=1)
    headers = ["mesh (dp x tp)", "train state / rank (MiB)", "state vs dp 4",
               common.peak_label("cpu"), "time / step (ms)", "tokens/s", "tokens/s vs dp 4"]
    rows = [[flagged(c["name"], c), fmt(median(c, "state_mib"), ".3f"),
             fmt(ratio(median(c, "state_mib"), median(fsdp, "state_mib")), ".3f"),
             fmt(median(c, "peak_mib"), ".1f"), fmt(median(c, "step_ms"), ".2f"),
             fmt(median(c, "tokens_per_s"), ",.0f"),
             fmt(ratio(median(c, "tokens_per_s"), median(fsdp, "tokens_per_s")), ".2f")]
            for c in configs]
    return ["\n### Tensor parallel: FSDP2 + --tp-degree on 4 ranks (CPU, gloo)\n",
            f"{fsdp2.MODEL_SAID}, global batch {fsdp2.BATCH} x {fsdp2.SEQ_LEN} tokens, "
            f"{ctx.args.fsdp2_steps} steps; {runs_said(ctx.args)}. dp 4 x tp 1 is plain FSDP2; "
            "tp T splits each layer over T ranks, which read the same rows, and FSDP2 shards "
            "over the 4 / T others.\n",
            markdown_table(headers, rows)]
