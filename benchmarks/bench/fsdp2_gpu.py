"""fsdp2-gpu: FSDP2 at scale, configuration C1B (1,041,640,704 parameters) on one GPU, as issue
19 measured it: eager, --compile, float8, activation checkpointing, CPU offload and checkpoint
saves; tokens/s against the upstream example, TFLOP/s, MFU, peak memory, save pauses."""
import torch

from . import common
from .common import flagged, fmt, markdown_table, median, ratio, runs_said

NAME, ORDER = "fsdp2-gpu", 60
C1B = ["--mixed-precision", "--dim", "2048", "--n-layers", "18", "--n-heads", "16",
       "--vocab-size", "32000", "--seq-len", "2048", "--lr", "3e-4"]
RUNS = {"eager": ["--batch-size", "8"], "--compile": ["--batch-size", "8", "--compile"],
        "--batch-size 16 --compile": ["--batch-size", "16", "--compile"],
        # torchao's float8 (issue 51; needs torchao and a GPU of compute capability 8.9+)
        "--float8 tensorwise --batch-size 16 --compile": ["--batch-size", "16", "--compile",
                                                         "--float8", "tensorwise"],
        "--float8 rowwise --batch-size 16 --compile": ["--batch-size", "16", "--compile",
                                                      "--float8", "rowwise"],
        "--activation-checkpointing": ["--batch-size", "8", "--activation-checkpointing"],
        "--cpu-offload": ["--batch-size", "8", "--cpu-offload"],
        # 201 steps, saves of 12.5 GB at steps 100, 200 and 201 (37.5 GB; the GPU machines'
        # disk holds 64 GB). The later pause is the save at step 200's: step 201 waits for its
        # copy to host memory, which a save at the last step would leave unmeasured (0.03 s
        # where step 201 waited 5.6 s, H200, torch 2.11, 2026-11-26). The save at step 201
        # waits for the background write before it (the script's "Waited" line).
        "checkpoint full": ["--batch-size", "8", "--save-every", "100"],
        "checkpoint sharded": ["--batch-size", "8", "--save-every", "100",
                               "--checkpoint-format", "sharded"],
        "checkpoint sharded --async-checkpoint": ["--batch-size", "8", "--save-every", "100",
                                                  "--checkpoint-format", "sharded",
                                                  "--async-checkpoint"]}
UPSTREAM_C1B_TOKENS_PER_S = 67_300  # pytorch/examples distributed/FSDP2 on an H100 (issue 19)


def check(args, asked, error):
    if asked and (args.no_gpu or not torch.cuda.is_available()):
        error("fsdp2-gpu runs a 1B-parameter model on a CUDA GPU, and none is visible here")


def runs(ctx):
    """World size 1 on the first GPU; the checkpoints in the run's folder (removed after each
    run: C1B's are 37.5 GB)."""
    configs = []
    for name, flags in RUNS.items():
        saves = name.startswith("checkpoint")
        configs.append({"device": "cuda", "world_size": 1, "name": name,
                        "script": "fsdp2_transformer.py",
                        "args": [*C1B, *flags, "--steps", "201" if saves else "40",
                                 "--log-every", "10",
                                 *(["--checkpoint-dir", "ckpt"] if saves else [])]})
    return configs


def figures(config, metrics, stdout, seen):
    stalls = metrics["checkpoint_stall_s"] or [None]
    return {**common.memory_figures(metrics), "tokens_per_s": metrics["tokens_per_s"],
            "mfu": metrics["mfu"], "tflops": metrics["tflops_per_gpu"],
            "first_pause_s": stalls[0],
            "later_pause_s": stalls[1] if len(stalls) > 1 else None}  # step 200's


def tables(ctx, configs):
    headers = ["configuration", "tokens/s", "vs upstream example", "TFLOP/s", "MFU",
               common.peak_label("cuda"), "first save's pause (s)", "later save's pause (s)"]
    rows = [[flagged(c["name"], c), fmt(median(c, "tokens_per_s"), ",.0f"),
             fmt(ratio(median(c, "tokens_per_s"), UPSTREAM_C1B_TOKENS_PER_S), ".3f"),
             fmt(median(c, "tflops"), ".1f"), fmt(median(c, "mfu"), ".1%"),
             fmt(median(c, "peak_mib"), ",.0f"), fmt(median(c, "first_pause_s"), ".2f"),
             fmt(median(c, "later_pause_s"), ".2f")]
            for c in configs]
    return ["\n### FSDP2 at scale: C1B on one GPU\n",
            f"`{' '.join(C1B)}` (1,041,640,704 parameters), world size 1; {runs_said(ctx.args)}. "
            "tokens/s, TFLOP/s and MFU are the script's steady state (the first step, and the "
            "first two with --compile, and checkpoint pauses left out); the upstream example "
            f"(pytorch/examples distributed/FSDP2, same sizes and loss) ran at "
            f"{UPSTREAM_C1B_TOKENS_PER_S:,} tokens/s on an H100 (issue 19). A pause is how long "
            "training stopped for a save; the later one is the save at step 200's, step 201's "
            "wait for its copy included.\n", markdown_table(headers, rows)]
