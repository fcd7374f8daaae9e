"""t5: T5 fine-tuning (world size 2 on CPU, fp32): FSDP1's FULL_SHARD, SHARD_GRAD_OP and NO_SHARD
with BACKWARD_PRE, FULL_SHARD with BACKWARD_POST and with no backward prefetch; FSDP2's FULL_SHARD
and SHARD_GRAD_OP (--fsdp-version 2). On the GPU, world size 1, fp32 against bf16."""
from . import common
from .common import find, flagged, fmt, markdown_table, median, ratio, runs_said

NAME, ORDER = "t5", 30
DEFAULT = PER_DEVICE = True  # run without --only; on the CPU, then the GPU
FIXTURES = {"t5"}
SIZES = ["--input-length", "64", "--output-length", "24", "--num-train-samples", "128",
         "--num-val-samples", "31", "--batch-size", "4", "--test-batch-size", "4"]
# (--fsdp-version, --sharding-strategy, --backward-prefetch); FSDP2 always prefetches as PRE does.
CPU_CONFIGS = [(1, "FULL_SHARD", "BACKWARD_PRE"), (1, "SHARD_GRAD_OP", "BACKWARD_PRE"),
               (1, "NO_SHARD", "BACKWARD_PRE"), (1, "FULL_SHARD", "BACKWARD_POST"),
               (1, "FULL_SHARD", "NONE"), (2, "FULL_SHARD", "BACKWARD_PRE"),
               (2, "SHARD_GRAD_OP", "BACKWARD_PRE")]


def add_flags(group):
    group.add_argument("--t5-epochs", type=int, default=3, metavar="N", help="epochs per T5 run")


def check(args, asked, error):
    common.at_least_one(args, error, "t5_epochs")


def runs(ctx, device):
    on_cpu = device == "cpu"
    # On CPU, fp32 for every strategy (bf16 has no native units there): a like-for-like
    # comparison. At world size 1, FSDP1 runs every strategy as NO_SHARD, so on the GPU only
    # fp32 and bf16 are compared, for both FSDP versions.
    configs = ([(*config, "fp32") for config in CPU_CONFIGS] if on_cpu else
               [(version, "FULL_SHARD", "BACKWARD_PRE", precision)
                for version in (1, 2) for precision in ("fp32", "bf16")])
    return [{"device": device, "world_size": 2 if on_cpu else 1, "fsdp_version": version,
             "name": f"FSDP{version} {strategy} {prefetch} {precision}",
             "strategy": strategy, "prefetch": prefetch, "precision": precision,
             "script": "t5_fsdp_finetune.py",
             "args": ["--model-name", str(ctx.t5_model), "--data-dir", str(ctx.wikihow_dir),
                      "--epochs", str(ctx.args.t5_epochs), *SIZES, "--fsdp-version", str(version),
                      "--sharding-strategy", strategy, "--backward-prefetch", prefetch,
                      "--mixed-precision", precision, "--no-save-model",
                      *(["--cpu"] if on_cpu else [])]}
            for version, strategy, prefetch, precision in configs]


def figures(config, metrics, stdout, seen):
    """A run of t5_fsdp_finetune.py: its steady epoch and its own samples/s (hf-load's and
    hf-export's runs too)."""
    return {**common.memory_figures(metrics),
            "epoch_s": common.steady_epoch_time(metrics["epoch_times"]),
            "samples_per_s": metrics["samples_per_s"],
            # bf16 falls back to fp32 without native bf16
            "precision_used": metrics["mixed_precision"]}


def tables(ctx, configs, device):
    base = find(configs, fsdp_version=1, strategy="FULL_SHARD", prefetch="BACKWARD_PRE",
                precision="fp32")
    no_shard = find(configs, fsdp_version=1, strategy="NO_SHARD", prefetch="BACKWARD_PRE",
                    precision="fp32")
    headers = ["FSDP", "sharding strategy", "backward prefetch", "precision", "world size",
               "train state / rank (MiB)", "state vs NO_SHARD", common.peak_label(device),
               "epoch time (s)", "train samples/s",
               "samples/s vs FSDP1 FULL_SHARD BACKWARD_PRE fp32"]
    rows = []
    for c in configs:
        used = sorted({f["precision_used"] for f in c["figures"]})
        precision = c["precision"] + ("" if used in ([], [c["precision"]])
                                      else f" (ran as {'/'.join(used)})")
        rows.append([c["fsdp_version"], flagged(c["strategy"], c), c["prefetch"], precision,
                     c["world_size"], fmt(median(c, "state_mib"), ".3f"),
                     fmt(ratio(median(c, "state_mib"), median(no_shard, "state_mib")), ".2f"),
                     fmt(median(c, "peak_mib"), ".1f"), fmt(median(c, "epoch_s"), ".3f"),
                     fmt(median(c, "samples_per_s"), ",.1f"),
                     fmt(ratio(median(c, "samples_per_s"), median(base, "samples_per_s")),
                         ".2f")])
    return [f"\n### T5 fine-tuning: FSDP1 and FSDP2, sharding strategies, backward prefetch "
            f"({common.where(device)})\n",
            f"{ctx.t5_source}; input 64 and output 24 tokens, 128 training and 31 validation "
            f"articles, batch size 4 per rank, {ctx.args.t5_epochs} epochs, --no-save-model; "
            f"{runs_said(ctx.args)}. Epoch time includes validation; train samples/s is the "
            "script's samples_per_s (training time of every epoch, validation excluded).\n",
            markdown_table(headers, rows)]
