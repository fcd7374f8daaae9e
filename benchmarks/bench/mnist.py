"""mnist: DDP vs FSDP1 vs FSDP1 with size-based auto-wrap (world size 2 on CPU, 1 on the GPU):
the performance table of the MNIST tutorial (seed 000), measured."""
import math
import re

from . import common
from .common import find, flagged, fmt, markdown_table, median, ratio, runs_said
from .fixtures import mnist_train_samples

NAME, ORDER = "mnist", 10
DEFAULT = PER_DEVICE = True  # run without --only; on the CPU, then the GPU
FIXTURES = {"mnist"}
ROWS = [("DDP", "ddp_mnist.py", []), ("FSDP1 FULL_SHARD", "fsdp1_mnist.py", []),
        ("FSDP1 FULL_SHARD, auto-wrap 20000", "fsdp1_mnist.py",
         ["--auto-wrap-min-params", "20000"])]


def add_flags(group):
    group.add_argument("--mnist-epochs", type=int, default=3, metavar="N",
                       help="epochs per MNIST run")


def check(args, asked, error):
    common.at_least_one(args, error, "mnist_epochs")


def runs(ctx, device):
    on_cpu = device == "cpu"
    return [{"device": device, "world_size": 2 if on_cpu else 1, "name": name,
             "data_dir": ctx.mnist_dir, "script": script,
             "args": ["--data-dir", str(ctx.mnist_dir), "--epochs", str(ctx.args.mnist_epochs),
                      *flags, *(["--no-cuda"] if on_cpu else [])]}
            for name, script, flags in ROWS]


def figures(config, metrics, stdout, seen):
    found = common.memory_figures(metrics)
    found["epoch_s"] = common.steady_epoch_time(metrics["epoch_times"])
    # DistributedSampler pads the training set to a multiple of the world size: every rank
    # trains on ceil(N / world size) samples an epoch.
    world_size = config["world_size"]
    samples = math.ceil(mnist_train_samples(config["data_dir"]) / world_size) * world_size
    found["samples_per_s"] = samples / found["epoch_s"]
    if config["device"] == "cuda":
        # Printed, not in the metrics file: the training time of all epochs.
        event = re.search(r"CUDA event elapsed time: ([\d.]+)sec", stdout)
        found["cuda_event_s"] = float(event.group(1)) if event else None
    return found


def tables(ctx, configs, device):
    on_gpu = device == "cuda"
    ddp = find(configs, name="DDP")
    headers = (["configuration", "world size", "train state / rank (MiB)", "state vs DDP",
                common.peak_label(device), "epoch time (s)", "time vs DDP", "train samples/s"]
               + (["CUDA-event time, all epochs (s)"] if on_gpu else []))
    rows = [[flagged(c["name"], c), c["world_size"], fmt(median(c, "state_mib"), ".3f"),
             fmt(ratio(median(c, "state_mib"), median(ddp, "state_mib")), ".2f"),
             fmt(median(c, "peak_mib"), ".1f"), fmt(median(c, "epoch_s"), ".3f"),
             fmt(ratio(median(c, "epoch_s"), median(ddp, "epoch_s")), ".2f"),
             fmt(median(c, "samples_per_s"), ",.0f")]
            + ([fmt(median(c, "cuda_event_s"), ".3f")] if on_gpu else [])
            for c in configs]
    return [f"\n### MNIST: DDP vs FSDP1 ({common.where(device)})\n",
            f"{ctx.mnist_source}; batch size 64 per rank, {ctx.args.mnist_epochs} epochs, "
            f"Adadelta; {runs_said(ctx.args)}. Epoch time includes the test pass; train "
            "samples/s = training samples of an epoch / epoch time."
            + (" At world size 1 FSDP1 runs FULL_SHARD as NO_SHARD: nothing is sharded."
               if on_gpu else "")
            + "\n",
            markdown_table(headers, rows)]

