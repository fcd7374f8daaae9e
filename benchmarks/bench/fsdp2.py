"""fsdp2: fully_shard on the small Transformer (world size 1, 2, and 4 where there are 4 cores;
1 on the GPU): plain, --explicit-prefetching, --mixed-precision, --no-reshard-after-forward;
training state per rank against the ideal 1/N."""
from . import common
from .common import find, flagged, fmt, markdown_table, median, ratio, runs_said

NAME, ORDER = "fsdp2", 20
DEFAULT = PER_DEVICE = True  # run without --only; on the CPU, then the GPU
OPTIONS = {"plain": [], "explicit-prefetching": ["--explicit-prefetching"],
           "mixed-precision": ["--mixed-precision"],
           "no-reshard-after-forward": ["--no-reshard-after-forward"]}
# The script's defaults, passed explicitly: the time per step is tokens per step / tokens/s.
BATCH, SEQ_LEN = 32, 32
MODEL_SAID = "Default model (vocab 128, dim 64, 2 layers, 4 heads)"


def add_flags(group):
    add = group.add_argument
    add("--fsdp2-steps", type=int, default=100, metavar="N",
        help="optimizer steps per FSDP2 run")
    add("--fsdp2-world-sizes", nargs="+", type=int, default=None, metavar="N",
        help="FSDP2 world sizes on CPU (unset: 1 2, and 4 when there are at least 4 CPU cores)")
    add("--fsdp2-options", nargs="+", choices=list(OPTIONS), default=list(OPTIONS),
        metavar="OPTION", help=f"FSDP2 configurations, any of {', '.join(OPTIONS)}")


def check(args, asked, error):
    common.at_least_one(args, error, "fsdp2_steps")
    if args.fsdp2_world_sizes and min(args.fsdp2_world_sizes) < 1:
        error("--fsdp2-world-sizes must be at least 1")


def steps_args(args):
    """The flags of a run of args.fsdp2_steps steps of BATCH x SEQ_LEN tokens (tp's too)."""
    return ["--steps", str(args.fsdp2_steps), "--batch-size", str(BATCH), "--seq-len",
            str(SEQ_LEN), "--log-every", str(args.fsdp2_steps)]


def runs(ctx, device):
    world_sizes = [1]
    if device == "cpu":
        world_sizes = ctx.args.fsdp2_world_sizes
        if world_sizes is None:
            world_sizes = [1, 2] + ([4] if ctx.cores >= 4 else [])
            if ctx.cores < 4:
                ctx.notes.append(f"FSDP2 at world size 4 skipped: this machine has {ctx.cores} "
                                 "CPU cores, and 4 processes on fewer cores would measure the "
                                 "oversubscription rather than FSDP2.")
    return [{"device": device, "world_size": world_size, "name": name,
             "script": "fsdp2_transformer.py",
             "args": [*steps_args(ctx.args), *OPTIONS[name],
                      *(["--cpu"] if device == "cpu" else [])]}
            for world_size in world_sizes for name in ctx.args.fsdp2_options]


def figures(config, metrics, stdout, seen):
    return {**common.memory_figures(metrics), "tokens_per_s": metrics["tokens_per_s"],
            "step_ms": 1000 * BATCH * SEQ_LEN / metrics["tokens_per_s"]}


def tables(ctx, configs, device):
    headers = ["world size", "options", "train state / rank (MiB)", "state vs world size 1",
               "ideal 1/N", common.peak_label(device), "time / step (ms)", "tokens/s",
               "tokens/s vs plain"]
    rows = []
    for c in configs:
        single = find(configs, world_size=1, name=c["name"])
        plain = find(configs, world_size=c["world_size"], name="plain")
        rows.append([c["world_size"], flagged(c["name"], c), fmt(median(c, "state_mib"), ".3f"),
                     fmt(ratio(median(c, "state_mib"), median(single, "state_mib")), ".3f"),
                     f"{1 / c['world_size']:.3f}", fmt(median(c, "peak_mib"), ".1f"),
                     fmt(median(c, "step_ms"), ".2f"), fmt(median(c, "tokens_per_s"), ",.0f"),
                     fmt(ratio(median(c, "tokens_per_s"), median(plain, "tokens_per_s")),
                         ".2f")])
    return [f"\n### FSDP2: fully_shard on the small Transformer ({common.where(device)})\n",
            f"{MODEL_SAID}, global batch {BATCH} x {SEQ_LEN} tokens, {ctx.args.fsdp2_steps} "
            f"steps; {runs_said(ctx.args)}. tokens/s and time / step cover every step, the first "
            "included; mixed-precision is bf16 compute with fp32 reduction"
            + (" (slower on CPUs without native bf16)" if device == "cpu"
               else "; its tokens/s vs plain is the bf16 speed-up")
            + ".\n",
            markdown_table(headers, rows)]
