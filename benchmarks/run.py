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

- MNIST (world size 2, CPU): DDP vs FSDP1 vs FSDP1 with size-based auto-wrap, seed 000's table
  measured.
- FSDP2 (world size 1, 2, and 4 where there are 4 cores): plain, --explicit-prefetching,
  --mixed-precision, --no-reshard-after-forward; training state per rank against the ideal 1/N.
- T5 (world size 2, CPU, fp32): FSDP1's FULL_SHARD, SHARD_GRAD_OP and NO_SHARD with BACKWARD_PRE,
  FULL_SHARD with BACKWARD_POST and with no backward prefetch; FSDP2's FULL_SHARD and
  SHARD_GRAD_OP (--fsdp-version 2).
- Tensor parallel (world size 4, CPU, only when asked for): FSDP2's default model as (dp, tp) =
  (4, 1), (2, 2) and (1, 4) with --tp-degree; tokens/s and training state per rank.
- Checkpoint pauses (world size 2, CPU, only when asked for): issue 34's 55M-parameter model, 30
  steps, without checkpoints, with synchronous sharded saves every 3 steps and with the background
  writer process (--async-checkpoint); --thread-writer-script adds a row for another copy of the
  script (the thread writer of main before issue 34). Its runs take turns (one of each
  configuration, then again), so that the machine's drift touches every row alike.
- LoRA (world size 2, CPU, fp32 compute, only when asked for: 33 minutes on 2 cores): a
  t5-base-shaped T5 (198M parameters, random weights, written by tests/tiny_wikihow.py), full
  fine-tuning and LoRA (rank 16 on q,v) with an fp32 and a bf16 base, under FSDP1 and FSDP2; and
  full fine-tuning with AdamW(foreach=True) and AdamW(fused=True), from copies of the script with
  that one line changed. Its runs take turns, as the checkpoint rows do. --plan's memory per rank
  at 1-64 ranks, with the measured runs on it, as a picture with --lora-plot (matplotlib).
- LoRA on one GPU (lora-gpu, only when asked for): the same model and rows at world size 1 on the
  GPU, with bf16 compute and longer sequences (512 + 128 tokens, 16 a batch): peak CUDA memory.
- Loading memory (world sizes 2 and 4, CPU, only when asked for: 10 minutes on 2 busy cores): the
  same t5-base-shaped T5 stored in bf16 and fp32 (--hf-load-dtypes), each as safetensors and as a
  pytorch_model.bin; FSDP2 with --cpu-ram-efficient-loading and LoRA reads it shard by shard from
  the safetensors, or from rank 0 from the .bin (today's way). Each rank's peak anonymous memory
  (RssAnon, sampled every 10 ms by benchmarks/hf_memory.py) until the model is sharded, above the
  tests' tiny T5's, against the target (model / world size) + 25% of the model. One run per
  configuration (--hf-load-repeats).
- Export memory (hf-export, world sizes 2 and 4, CPU, only when asked for): the same model stored in
  the first of --hf-load-dtypes, LoRA, one epoch, then the export of the merged model: shard by
  shard (DCP's HF writer, in files of a quarter of the model) and gathered on rank 0
  (--full-state-dict, today's way). Each rank's RssAnon from the line before
  the export until its `Saved` line, above what the rank held as the export began (glibc made to
  return freed memory: hf_memory.RETURN_FREED).
- Memory returned on CPU (cpu-memory, world size 2, CPU, only when asked for: 12 minutes on 2
  cores): each script as it runs by default (glibc keeps freed memory for reuse) and with
  --return-freed-memory (its mmap threshold fixed at 256 KiB), taking turns: each rank's peak
  RssAnon, and for T5 its rise above the level after loading, at t5-base's shape with LoRA too.
- Variable lengths (lengths, world size 2, CPU, only when asked for): T5 at t5-base's shape, the
  tutorial's lengths (512 + 150 tokens), each example padded to them (the default) against
  --max-tokens as many tokens as the padded batch, on the fixture's articles and on articles
  whose lengths follow WikiHow's published statistics (benchmarks/wikihow_lengths.py): samples/s.
  fsdp2_transformer.py's documents packed (--pack-documents) against one per row
  (--pad-documents): useful tokens/s, those of documents, not padding. The ways take turns.
- Fault tolerance (fault-tolerance, 4 processes, CPU, only when asked for; torchft and psutil
  needed): fsdp2_transformer.py's default model, a rank of the second replica killed (SIGKILL) at
  step 25 with sharded checkpoints every 10 steps: torchft's replica groups (--fault-tolerance, 2
  groups of 2 ranks) against a full restart (HSDP on 4 ranks, torchrun --max-restarts 1). From
  the step lines' times: the survivors' longest pause, the seconds from the kill to the first new
  step and to the killed replica's first step once back; the steps run again and those the
  survivors trained alone. The ways take turns.
- With a CUDA GPU, each benchmark again at world size 1 on the GPU: peak CUDA allocated memory,
  CUDA-event time (MNIST, the one script that reports it) and the bf16 speed-up (FSDP2
  --mixed-precision, T5 --mixed-precision bf16).

A failed run prints its command and the end of its stderr at once; its configuration reads FAILED
in the table, and the harness exits with status 1 after printing the tables. benchmarks/README.md
says what every column means.
"""
import argparse
import json
import math
import os
import platform
import re
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS = ("mnist", "fsdp2", "t5", "checkpoint", "fsdp2-gpu", "tp", "lora", "lora-gpu",
              "hf-load", "hf-export", "cpu-memory", "lengths", "fault-tolerance")
# fsdp2-gpu: configuration C1B (1,041,640,704 parameters) on one GPU, as issue 19 measured it.
C1B = ["--mixed-precision", "--dim", "2048", "--n-layers", "18", "--n-heads", "16",
       "--vocab-size", "32000", "--seq-len", "2048", "--lr", "3e-4"]
C1B_RUNS = {"eager": ["--batch-size", "8"], "--compile": ["--batch-size", "8", "--compile"],
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
# checkpoint: issue 34's model (about 660 MB of sharded checkpoint state on 2 ranks), a save every
# 3 steps; the rows differ only in how they save.
CHECKPOINT_MODEL = ["--dim", "768", "--n-layers", "6", "--n-heads", "12", "--vocab-size", "8000",
                    "--seq-len", "32", "--batch-size", "4", "--steps", "30", "--log-every", "10"]
CHECKPOINT_SAVES = ["--checkpoint-dir", "ckpt", "--save-every", "3", "--checkpoint-format",
                    "sharded"]
CHECKPOINT_RUNS = {"no checkpoints": [], "synchronous sharded": CHECKPOINT_SAVES,
                   "process writer (--async-checkpoint)": [*CHECKPOINT_SAVES,
                                                           "--async-checkpoint"]}
# tp: FSDP2's default model on 4 CPU ranks, as (dp, tp) = (4, 1), (2, 2) and (1, 4) (--tp-degree)
TP_DEGREES = (1, 2, 4)
UPSTREAM_C1B_TOKENS_PER_S = 67_300  # pytorch/examples distributed/FSDP2 on an H100 (issue 19)
FSDP2_OPTIONS = {"plain": [], "explicit-prefetching": ["--explicit-prefetching"],
                 "mixed-precision": ["--mixed-precision"],
                 "no-reshard-after-forward": ["--no-reshard-after-forward"]}
# The script's defaults, passed explicitly: the time per step is tokens per step / tokens/s.
FSDP2_BATCH, FSDP2_SEQ_LEN = 32, 32
T5_SIZES = ["--input-length", "64", "--output-length", "24", "--num-train-samples", "128",
            "--num-val-samples", "31", "--batch-size", "4", "--test-batch-size", "4"]
# (--fsdp-version, --sharding-strategy, --backward-prefetch); FSDP2 always prefetches as PRE does.
T5_CONFIGS = [(1, "FULL_SHARD", "BACKWARD_PRE"), (1, "SHARD_GRAD_OP", "BACKWARD_PRE"),
              (1, "NO_SHARD", "BACKWARD_PRE"), (1, "FULL_SHARD", "BACKWARD_POST"),
              (1, "FULL_SHARD", "NONE"), (2, "FULL_SHARD", "BACKWARD_PRE"),
              (2, "SHARD_GRAD_OP", "BACKWARD_PRE")]
# lengths: T5 at t5-base's shape with the tutorial's lengths, 2 articles per rank a step (a padded
# step takes about 40 s on a CPU core), one step an epoch; the second epoch's samples/s (the first
# pays for warm-up). --max-tokens: as many tokens as the padded batch holds, so that no
# micro-batch needs more memory than it.
LENGTHS_T5 = ["--input-length", "512", "--output-length", "150", "--batch-size", "2",
              "--num-train-samples", "4", "--epochs", "2", "--no-run-validation",
              "--no-save-model", "--mixed-precision", "fp32", "--cpu"]
LENGTHS_T5_WAYS = {"padded (the default)": [], "--max-tokens 1324": ["--max-tokens", "1324"]}
LENGTHS_T5_DATA = ("the tests' fixture", "WikiHow's lengths")
# fsdp2: a 21M-parameter model on rows of 256 tokens, 8 a step (a step of about 3 s on CPU).
LENGTHS_FSDP2 = ["--dim", "512", "--n-layers", "4", "--n-heads", "8", "--vocab-size", "8000",
                 "--seq-len", "256", "--batch-size", "8", "--steps", "6", "--log-every", "6",
                 "--pack-documents", "--cpu"]
LENGTHS_FSDP2_WAYS = {"one document per row (--pad-documents)": ["--pad-documents"],
                      "packed (--pack-documents)": []}
# fault-tolerance: FSDP2's default model, a step line per step, a sharded checkpoint every 10 steps;
# SIGKILL of the second replica's second rank once a line says step 25 (the full restart then
# trains steps 21-25 again from step 20's checkpoint). 200 steps: the killed group restarts and
# heals (about 15 s on 2 busy cores) while the other still trains.
FT_RUN = ["--steps", "200", "--log-every", "1", "--checkpoint-dir", "ckpt", "--checkpoint-format",
          "sharded", "--save-every", "10", "--cpu"]
FT_KILL_STEP = 25
# way: (its flags, how it starts, the process killed: its arguments and environment, and the line
# that says the killed replica is back)
FT_WAYS = {
    "torchft: 2 replica groups of 2 ranks (--fault-tolerance --world-size 2)": (
        ["--fault-tolerance", "--world-size", "2"], {"python": True, "metrics_world_size": 2},
        {"args": ["--replica-group", "1"], "env": {"LOCAL_RANK": "1"},
         "back": r"^\[group 1\] step \d+: healed"}),
    "full restart: HSDP on 4 ranks (--replicate-degree 2, torchrun --max-restarts 1)": (
        ["--replicate-degree", "2"], {"torchrun_flags": ["--max-restarts", "1"]},
        {"args": [], "env": {"RANK": "3"}, "back": r"^Resumed from "})}
# A step line of fsdp2_transformer.py, with the replica group's name where it started the groups
FT_STEP_LINE = re.compile(r"^(?:\[group (\d+)\] )?step (\d+) \|")
# lora: t5-base's shape (d_model 768, 12 + 12 layers, 12 heads of 64, d_ff 3072, 32 relative
# attention buckets) with random weights and the tests' tokenizer (232 ids): 198,407,424
# parameters, 0.79 GB in fp32, made offline by tests/tiny_wikihow.py's write_tiny_t5.
T5_BASE_SHAPE = {"d_model": 768, "num_layers": 12, "num_heads": 12, "d_kv": 64, "d_ff": 3072,
                 "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128}
T5_BASE_VOCAB = 32128  # t5-base's own: the picture's dotted lines (--plan needs a config only)
# 8 articles are one step of 4 per rank: each epoch is one optimizer step (CPU steps of a 198M
# model take seconds); samples/s is taken over the epochs after the first (warm-up, FSDP2's lazy
# initialization), validation off.
LORA_TRAIN_SAMPLES, LORA_EPOCHS = 8, 4
LORA_SIZES = ["--input-length", "64", "--output-length", "24", "--batch-size", "4",
              "--mixed-precision", "fp32", "--cpu"]  # the runs' and the plans' (batch per rank)
LORA_RUN = ["--num-train-samples", str(LORA_TRAIN_SAMPLES), "--epochs", str(LORA_EPOCHS),
            "--no-run-validation", "--no-save-model"]
# lora-gpu: a GPU step of 4 short articles takes milliseconds; these take long enough to time.
LORA_GPU_SAMPLES, LORA_GPU_EPOCHS = 256, 3
LORA_GPU_SIZES = ["--input-length", "512", "--output-length", "128", "--batch-size", "16",
                  "--mixed-precision", "bf16"]
LORA = ["--lora-rank", "16"]  # the script's defaults otherwise: alpha 16, dropout 0.05, q,v
LORA_ROWS = {"full fine-tuning": [], "LoRA, fp32 base": LORA,
             "LoRA, bf16 base": [*LORA, "--base-dtype", "bf16"]}
# The AdamW rows run a copy of t5_fsdp_finetune.py whose optimizer line ends in this, changed to
# pass foreach=True or fused=True (CPU AdamW steps tensor by tensor by default).
ADAMW_LINE_END = "lr=args.lr)"
ADAMW_VARIANTS = ("foreach", "fused")
# The picture's curves: --plan's flags beside LORA_SIZES, and how each is drawn.
LORA_CURVES = {f"{row}, FSDP{version} FULL_SHARD": [*flags, "--fsdp-version", str(version)]
               for row, flags in LORA_ROWS.items() for version in (1, 2)}
LORA_CURVES.update({"full fine-tuning, FSDP1 SHARD_GRAD_OP": ["--sharding-strategy",
                                                               "SHARD_GRAD_OP"],
                    "full fine-tuning, FSDP1 NO_SHARD (as DDP)": ["--sharding-strategy",
                                                                  "NO_SHARD"]})
CURVE_COLOURS = {"full fine-tuning": "tab:blue", "LoRA, fp32 base": "tab:green",
                 "LoRA, bf16 base": "tab:purple", "SHARD_GRAD_OP": "tab:orange",
                 "NO_SHARD": "black"}
PLAN_WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64)
# hf-load: each rank's anonymous memory (RssAnon) while FSDP2's --cpu-ram-efficient-loading loads
# the t5-base-shaped model stored in bf16 (and fp32), shard by shard from its safetensors (the
# new way) and from rank 0 (a pytorch_model.bin: today's way), with LoRA so that the training
# state is small; each rank's peak until the script prints HF_LOAD_UNTIL (sharded and loaded),
# less the tests' tiny T5's at the same world size and rank.
HF_LOAD_WORLD_SIZES = (2, 4)
HF_LOAD_DTYPES = ("bf16", "fp32")
HF_LOAD_WAYS = {"shard by shard": "safetensors", "from rank 0": "pytorch_model.bin"}
HF_LOAD_RUN = ["--fsdp-version", "2", "--cpu-ram-efficient-loading", *LORA, "--cpu",
               "--input-length", "32", "--output-length", "16", "--num-train-samples", "4",
               "--num-val-samples", "4", "--epochs", "1", "--batch-size", "1", "--no-save-model",
               "--no-run-validation"]
HF_LOAD_UNTIL = "FSDP2 sharded"
HF_LOAD_FROM_RANK0 = "--cpu-ram-efficient-loading: the model has no safetensors files"
HF_LOAD_TARGET = 0.25  # the issue's: each rank at most (model / world size) + 25% of the model
# hf-export: the run of hf-load with validation and saving, so that epoch 1 exports its model.
HF_EXPORT_RUN = [flag for flag in HF_LOAD_RUN if flag not in ("--no-save-model",
                                                              "--no-run-validation")]
HF_EXPORT_WAYS = {"shard by shard (files of a quarter of the model)": [],
                  "gathered on rank 0 (--full-state-dict)": ["--full-state-dict"]}
HF_EXPORT_FROM, HF_EXPORT_UNTIL = "New Val Loss Record", "Saved "
# cpu-memory: each script's run as it is ("kept": glibc's default) and with --return-freed-memory
# ("returned"); RssAnon sampled every 10 ms, for T5 also its rise above the level after loading
# (the line CPU_MEMORY_LOADED).
CPU_MEMORY_WAYS = {"kept (the default)": [], "returned (--return-freed-memory)":
                   ["--return-freed-memory"]}
CPU_MEMORY_LOADED = "Peak memory per rank after loading the model"
STDERR_TAIL = 40  # lines of a failed run's stderr to show
MIB = 2**20


def fmt(value, spec):
    """A table cell: the formatted number, or n/a where there is none (a failed baseline, say)."""
    return "n/a" if value is None else format(value, spec)


def ratio(a, b):
    return a / b if a is not None and b else None


def markdown_table(headers, rows):
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def steady_epoch_time(epoch_times):
    """Median of the epochs after the first (which also pays for warm-up), or the only epoch."""
    return statistics.median(epoch_times[1:] or epoch_times)


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            names = re.findall(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        if names:
            return names[0].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def stderr_tail(stderr):
    """The end of the workers' stderr.

    torchrun's own failure report (its traceback) follows it and is cut.
    """
    lines = stderr.splitlines()
    cut = next((i for i, line in enumerate(lines) if "torch/distributed/elastic/" in line),
               len(lines))
    return "\n".join(lines[:cut][-STDERR_TAIL:] or lines[-STDERR_TAIL:])


def watch_writers(workdir, finished, seen):
    """Until finished is set, every 0.2 s: the CPU seconds (user + system) so far of each
    checkpoint writer of the run in workdir (DCP's spawned processes, in the run's folder), into
    seen {pid: seconds}. A writer is idle at its end (its last save is waited for): little is
    missed."""
    tick = os.sysconf("SC_CLK_TCK")
    while not finished.wait(0.2):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.readlink(f"/proc/{pid}/cwd") != str(workdir):
                    continue
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"spawn_main" not in f.read():
                        continue
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                seen[pid] = (int(fields[11]) + int(fields[12])) / tick  # utime + stime
            except (OSError, ValueError, IndexError):  # gone meanwhile
                continue


def cpu_seconds_of_children():
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def log(message):
    """Progress and failures go to stderr as the runs go; the tables go to stdout at the end."""
    print(message, file=sys.stderr, flush=True)


def write_fixture(what, command):
    """Run one of the tests' fixture generators; if it fails, say so and how to do without it.
    --dry-run: nothing (the commands name the folders it would write)."""
    if args.dry_run:
        return
    proc = subprocess.run([sys.executable, *map(str, command)], capture_output=True, text=True)
    if proc.returncode != 0:
        log(f"error: could not write the {what} fixture ({' '.join(map(str, command))}):\n"
            f"{proc.stderr.strip()}\n"
            "Install the test requirements (pip install -r requirements-test.txt) or pass the data "
            "directory of your own (see --help).")
        sys.exit(1)


def mnist_train_samples(data_dir):
    """Training images in the MNIST files: the count in the header of the IDX label file."""
    with open(Path(data_dir) / "MNIST" / "raw" / "train-labels-idx1-ubyte", "rb") as f:
        return int.from_bytes(f.read(8)[4:], "big")


def add_lora_flags(parser):
    add = parser.add_argument
    add("--lora-model", default=None, metavar="DIR",
        help="lora: a T5 directory instead of the t5-base-shaped random model (unset: written "
             "into the temporary folder, 0.79 GB)")
    add("--lora-adamw", nargs="*", choices=ADAMW_VARIANTS, default=list(ADAMW_VARIANTS),
        metavar="OPTION", help="lora: full fine-tuning also with AdamW(OPTION=True), any of "
        f"{', '.join(ADAMW_VARIANTS)} (none: no such rows)")
    add("--lora-plot", default=None, metavar="PNG",
        help="lora: draw memory per rank against world size (--plan, and the measured runs) "
             "into PNG; needs matplotlib (benchmarks/requirements.txt)")


def adamw_copy(folder, option):
    """A copy of t5_fsdp_finetune.py (and the module it imports) in folder whose AdamW takes
    option=True; None when the script's optimizer line is not the one expected."""
    text = (REPO / "t5_fsdp_finetune.py").read_text()
    lines = [line for line in text.splitlines()
             if "optim.AdamW(" in line and line.endswith(ADAMW_LINE_END)]
    if len(lines) != 1:
        return None
    folder.mkdir()
    for module in ("summarization_dataset.py", "safe_launch.py"):
        shutil.copy(REPO / module, folder)
    changed = lines[0][:-1] + f", {option}=True)"
    (folder / "t5_fsdp_finetune.py").write_text(text.replace(lines[0], changed))
    return folder / "t5_fsdp_finetune.py"


def kill_and_time(command, workdir, victim, env, timeout):
    """fault-tolerance's run: command, and a SIGKILL of its worker named by victim (arguments in
    its command line, variables of its environment) once a step line says FT_KILL_STEP.
    Returns (returncode, stdout, stderr, figures): the figures from the times the step lines came
    (seconds from the kill), None with a status of 1 where the kill or a step it times did not
    happen."""
    import psutil  # (benchmarks/requirements.txt)

    proc = subprocess.Popen(command, cwd=workdir, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    lines, errors = [], []  # (seconds, line)

    def read(stream, into):
        for line in stream:
            into.append((time.monotonic(), line))

    readers = [threading.Thread(target=read, args=(proc.stdout, lines)),
               threading.Thread(target=read, args=(proc.stderr, errors))]
    for reader in readers:
        reader.start()

    def steps():  # (seconds, group or None, step) of each step line so far
        found = ((at, FT_STEP_LINE.match(line)) for at, line in list(lines))
        return [(at, m[1] and int(m[1]), int(m[2])) for at, m in found if m]

    killed, deadline = None, time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline and killed is None:
        if any(step == FT_KILL_STEP for _, _, step in steps()):
            workers = [p for p in psutil.Process(proc.pid).children(recursive=True)
                       if "torch.distributed.run" not in p.cmdline()]
            for worker in workers:
                cmdline, environ = " ".join(worker.cmdline()), worker.environ()
                if (" ".join(victim["args"]) in cmdline
                        and all(environ.get(k) == v for k, v in victim["env"].items())):
                    worker.kill()
                    killed = time.monotonic()
                    break
        time.sleep(0.02)
    try:
        proc.wait(max(deadline - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        proc.wait()
    for reader in readers:
        reader.join()
    stdout, stderr = "".join(line for _, line in lines), "".join(line for _, line in errors)
    if proc.returncode != 0 or killed is None:
        return proc.returncode or 1, stdout, stderr + "\nharness: the kill did not happen", None
    seen = steps()
    survivors = [(at, step) for at, group, step in seen if group in (0, None)]
    # Lines of steps done before the kill may come just after it: 0.3 s to arrive
    last = max(step for at, step in survivors if at <= killed + 0.3)
    new = [at for at, step in survivors if at > killed + 0.3 and step > last]
    from_kill = [at for at, _ in survivors if at >= max(a for a, _ in survivors if a <= killed)]
    back = [at for at, line in lines if at > killed and re.search(victim["back"], line)]
    rejoined = [at for at, group, _ in seen if back and at >= back[0]
                and group == (1 if victim["args"] else None)]
    if not (new and rejoined):
        return 1, stdout, stderr + "\nharness: no step after the kill, or no rejoin", None
    before = [at for at, step in survivors if at <= killed and step > 5]
    return proc.returncode, stdout, stderr, {
        "step_ms": 1000 * statistics.median(b - a for a, b in zip(before, before[1:])),
        "pause_s": max(b - a for a, b in zip(from_kill, from_kill[1:])),
        "new_step_s": new[0] - killed, "rejoined_s": rejoined[0] - killed,
        "steps_again": len(survivors) - len({step for _, step in survivors}),
        "steps_alone": len([at for at, _ in survivors if killed < at < rejoined[0]])}


def figures_of(config, metrics, stdout):
    """One run's figures, in the units of the tables (which show their medians over the runs).

    Raises KeyError when the metrics file lacks a figure.
    """
    figures = {"state_mib": metrics["train_state_bytes"] / MIB,
               "peak_mib": metrics["peak_memory_bytes"] / MIB}
    if config["benchmark"] == "mnist":
        figures["epoch_s"] = steady_epoch_time(metrics["epoch_times"])
        # DistributedSampler pads the training set to a multiple of the world size: every rank
        # trains on ceil(N / world size) samples an epoch.
        world_size = config["world_size"]
        samples = math.ceil(mnist_train_samples(config["data_dir"]) / world_size) * world_size
        figures["samples_per_s"] = samples / figures["epoch_s"]
        if config["device"] == "cuda":
            # Printed, not in the metrics file: the training time of all epochs.
            event = re.search(r"CUDA event elapsed time: ([\d.]+)sec", stdout)
            figures["cuda_event_s"] = float(event.group(1)) if event else None
    elif config["benchmark"] in ("fsdp2", "tp"):
        figures["tokens_per_s"] = metrics["tokens_per_s"]
        figures["step_ms"] = 1000 * FSDP2_BATCH * FSDP2_SEQ_LEN / metrics["tokens_per_s"]
    elif config["benchmark"] == "checkpoint":
        # Over the whole run, the first step and every pause included (a wait for a copy inside
        # a step counts twice: in the step and in its save's pause).
        stalls, steps = metrics["checkpoint_stall_s"], metrics["step_times_s"][1:]
        figures.update(
            tokens_per_s=metrics["tokens_per_s"], first_pause_s=stalls[0] if stalls else None,
            later_pause_s=statistics.median(stalls[1:]) if len(stalls) > 1 else None,
            all_in_tokens_per_s=metrics["tokens_per_s"] * metrics["step_time_s"] * len(steps)
            / (sum(steps) + sum(stalls)))
    elif config["benchmark"] == "fsdp2-gpu":
        stalls = metrics["checkpoint_stall_s"] or [None]
        figures.update(tokens_per_s=metrics["tokens_per_s"], mfu=metrics["mfu"],
                       tflops=metrics["tflops_per_gpu"], first_pause_s=stalls[0],
                       later_pause_s=stalls[1] if len(stalls) > 1 else None)  # step 200's
    elif config["benchmark"] == "cpu-memory":  # RssAnon: from the sampling, added by the loop
        figures.update(train_loss=metrics["train_loss"], wall_s=metrics["wall_s"])
    elif config["benchmark"] == "lengths" and "fsdp2" in config["script"]:
        figures.update(useful_tokens_per_s=metrics["useful_tokens_per_s"],
                       tokens_per_s=metrics["tokens_per_s"], train_loss=metrics["train_loss"])
    elif config["benchmark"] == "fault-tolerance":  # its times: kill_and_time's, from the lines
        figures["final_loss"] = metrics["losses"][-1]
    elif config["benchmark"] in ("lora", "lora-gpu", "lengths"):  # the steady samples/s
        figures["epoch_s"] = steady_epoch_time(metrics["epoch_times"])
        figures["samples_per_s"] = config["samples"] / figures["epoch_s"]
        figures["loaded_mib"] = max(metrics["peak_memory_after_loading_per_rank"]) / MIB
    else:
        figures["epoch_s"] = steady_epoch_time(metrics["epoch_times"])
        figures["samples_per_s"] = metrics["samples_per_s"]
        # bf16 falls back to fp32 without native bf16
        figures["precision_used"] = metrics["mixed_precision"]
    return figures


def hf_load_figures(config, stdout, peaks, loaded):
    """hf-load's figures of one run: each rank's peak RssAnon (MiB) until the model was sharded
    and loaded. Raises ValueError when the run did not get there, or loaded another way."""
    if not loaded:
        raise ValueError(f"its output never said {HF_LOAD_UNTIL!r}")
    if sorted(peaks) != list(range(config["world_size"])):
        raise ValueError(f"RssAnon was sampled for ranks {sorted(peaks)}, not for each of "
                         f"{config['world_size']}")
    way = "from rank 0" if HF_LOAD_FROM_RANK0 in stdout else "shard by shard"
    if way != config["way"]:
        raise ValueError(f"it loaded {way}, not {config['way']}")
    return {f"rank{rank}_mib": peak / MIB for rank, peak in sorted(peaks.items())}


parser = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--only", nargs="+", choices=BENCHMARKS, default=list(BENCHMARKS[:3]),
                    metavar="NAME", help=f"benchmarks to run, any of {', '.join(BENCHMARKS)} "
                    "(checkpoint, tp, fsdp2-gpu (a 1B-parameter model on one GPU), lora, "
                    "lora-gpu (on one GPU), hf-load, hf-export, cpu-memory, lengths and "
                    "fault-tolerance only when asked for)")
parser.add_argument("--repeats", type=int, default=3, metavar="N",
                    help="runs per configuration; every figure is the median over them "
                         "(at least 3 without --smoke)")
parser.add_argument("--smoke", action="store_true",
                    help="allow --repeats below 3, to check that the harness works; "
                         "the tables say so")
parser.add_argument("--out", default=None, metavar="FILE", help="also write the markdown to FILE")
parser.add_argument("--raw-json", default=None, metavar="FILE",
                    help="write every run (command, metrics JSON, the figures taken from it) "
                         "to FILE")
parser.add_argument("--mnist-dir", default=None, metavar="DIR",
                    help="folder holding MNIST/raw (unset: the tests' digits fixture, "
                         "in a temporary folder)")
parser.add_argument("--wikihow-dir", default=None, metavar="DIR",
                    help="folder with wikihowAll.csv (unset: the tests' WikiHow fixture, "
                         "in a temporary folder)")
parser.add_argument("--t5-model", default=None, metavar="DIR_OR_ID",
                    help="T5 model directory or hub id (unset: the tests' tiny T5 fixture, "
                         "in a temporary folder)")
parser.add_argument("--mnist-epochs", type=int, default=3, metavar="N",
                    help="epochs per MNIST run")
parser.add_argument("--fsdp2-steps", type=int, default=100, metavar="N",
                    help="optimizer steps per FSDP2 run")
parser.add_argument("--t5-epochs", type=int, default=3, metavar="N", help="epochs per T5 run")
parser.add_argument("--fsdp2-world-sizes", nargs="+", type=int, default=None, metavar="N",
                    help="FSDP2 world sizes on CPU (unset: 1 2, and 4 when there are at least "
                         "4 CPU cores)")
parser.add_argument("--fsdp2-options", nargs="+", choices=list(FSDP2_OPTIONS),
                    default=list(FSDP2_OPTIONS), metavar="OPTION",
                    help=f"FSDP2 configurations, any of {', '.join(FSDP2_OPTIONS)}")
parser.add_argument("--thread-writer-script", default=None, metavar="FILE",
                    help="checkpoint: also run this copy of fsdp2_transformer.py with "
                         "--async-checkpoint (e.g. main before issue 34, whose writer is a thread)")
add_lora_flags(parser)
parser.add_argument("--hf-load-dtypes", nargs="+", choices=HF_LOAD_DTYPES,
                    default=list(HF_LOAD_DTYPES), metavar="DTYPE",
                    help="hf-load: the dtypes the t5-base-shaped model is stored in, any of "
                         f"{', '.join(HF_LOAD_DTYPES)}")
parser.add_argument("--hf-load-repeats", type=int, default=1, metavar="N",
                    help="hf-load: runs per configuration, the median taken (its memory does not "
                         "vary as times do; --repeats is for the others)")
parser.add_argument("--no-gpu", action="store_true",
                    help="skip the GPU runs even when a CUDA GPU is visible")
parser.add_argument("--timeout", type=int, default=900, metavar="S",
                    help="seconds before a run counts as failed")
parser.add_argument("--dry-run", action="store_true",
                    help="print every run's command and exit, running nothing (lora, hf-load: not "
                         "even writing the 198M model; lora: nor running --plan)")
args = parser.parse_args()
if args.repeats < 3 and not args.smoke:
    parser.error(f"--repeats {args.repeats}: a median needs at least 3 runs; "
                 "pass --smoke to run fewer anyway")
if args.repeats < 1:
    parser.error("--repeats must be at least 1")
for flag in ("mnist_epochs", "fsdp2_steps", "t5_epochs", "timeout", "hf_load_repeats"):
    if getattr(args, flag) < 1:
        parser.error(f"--{flag.replace('_', '-')} must be at least 1")
if args.fsdp2_world_sizes and min(args.fsdp2_world_sizes) < 1:
    parser.error("--fsdp2-world-sizes must be at least 1")
if "lora" in args.only and args.lora_plot and not args.dry_run:
    try:
        import matplotlib  # noqa: F401  (drawn by t5_memory.py, after the runs)
    except ImportError:
        parser.error("--lora-plot needs matplotlib: pip install -r benchmarks/requirements.txt")
if "fsdp2-gpu" in args.only and (args.no_gpu or not torch.cuda.is_available()):
    parser.error("fsdp2-gpu runs a 1B-parameter model on a CUDA GPU, and none is visible here")
if "lora-gpu" in args.only and (args.no_gpu or not torch.cuda.is_available()) and not args.dry_run:
    parser.error("lora-gpu runs on a CUDA GPU, and none is visible here")
if "fault-tolerance" in args.only and not args.dry_run:
    try:
        import psutil  # noqa: F401  (kill_and_time: the process to kill)
        import torchft  # noqa: F401  (--fault-tolerance)
    except ImportError as e:
        parser.error(f"fault-tolerance needs torchft and psutil ({e}): pip install -r "
                     "requirements-fault-tolerance.txt -r benchmarks/requirements.txt")

started = time.perf_counter()
cores = os.cpu_count() or 1
gpu = torch.cuda.is_available() and not args.no_gpu
notes = []  # said under the header: what was skipped, and why
fsdp2_world_sizes = args.fsdp2_world_sizes
if fsdp2_world_sizes is None:
    fsdp2_world_sizes = [1, 2] + ([4] if cores >= 4 else [])
    if cores < 4 and "fsdp2" in args.only:
        notes.append(f"FSDP2 at world size 4 skipped: this machine has {cores} CPU cores, "
                     "and 4 processes on fewer cores would measure the oversubscription rather "
                     "than FSDP2.")
tmp = Path(tempfile.mkdtemp(prefix="fsdp-bench-"))
env = dict(os.environ)

# --------------------------------------------------------------------------------------------- data
# The fixtures come from the tests' own generators, run through their command lines.
# Each run starts in a folder of its own: local paths must be absolute to mean the same there.
mnist_dir, wikihow_dir, t5_model = (os.path.abspath(p) if p and os.path.exists(p) else p
                                    for p in (args.mnist_dir, args.wikihow_dir, args.t5_model))
mnist_source = f"Data: MNIST from {mnist_dir}" if mnist_dir else None
t5_source = f"Model {t5_model}, WikiHow from {wikihow_dir}" if t5_model and wikihow_dir else None
if ("mnist" in args.only or "cpu-memory" in args.only) and not mnist_dir:
    mnist_dir = tmp / "mnist"
    log(f"Writing the MNIST digits fixture (tests/digits_mnist.py) to {mnist_dir}")
    write_fixture("MNIST digits", [REPO / "tests" / "digits_mnist.py", mnist_dir])
    mnist_source = ("Data: the offline digits fixture of the tests, not MNIST "
                    "(tests/digits_mnist.py: scikit-learn's digits as 28x28 MNIST files, "
                    f"{'?' if args.dry_run else mnist_train_samples(mnist_dir)} training images)")
if ("t5" in args.only or "cpu-memory" in args.only) and not (wikihow_dir and t5_model):
    fixture_data, fixture_model = tmp / "wikihow", tmp / "tiny-t5"
    log(f"Writing the WikiHow and tiny T5 fixtures (tests/tiny_wikihow.py) to {tmp}")
    write_fixture("WikiHow and tiny T5",
                  [REPO / "tests" / "tiny_wikihow.py", fixture_data, fixture_model])
    wikihow_dir, t5_model = wikihow_dir or fixture_data, t5_model or fixture_model
    t5_source = ("Model "
                 + ("the tiny T5 fixture of the tests" if t5_model == fixture_model
                    else str(t5_model))
                 + ", data "
                 + ("the WikiHow-format fixture CSV of the tests" if wikihow_dir == fixture_data
                    else f"WikiHow from {wikihow_dir}")
                 + " (tests/tiny_wikihow.py)")
    # The datasets library caches each CSV it reads; keep the fixture's cache out of the user's.
    env["HF_DATASETS_CACHE"] = str(tmp / "hf_datasets_cache")

if {"lora", "lora-gpu", "cpu-memory", "lengths"} & set(args.only):
    lora_model = args.lora_model  # a local folder made absolute: each run has its own folder
    if lora_model and os.path.exists(lora_model):
        lora_model = os.path.abspath(lora_model)
    lora_data = wikihow_dir
    if not lora_data:  # the t5 benchmark's fixture when it runs too, else the CSV alone
        lora_data = tmp / "wikihow"
        log(f"Writing the WikiHow fixture (tests/tiny_wikihow.py) to {lora_data}")
        write_fixture("WikiHow", ["-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                                  "import tiny_wikihow; tiny_wikihow.write_wikihow(sys.argv[2])",
                                  REPO / "tests", lora_data])
        env["HF_DATASETS_CACHE"] = str(tmp / "hf_datasets_cache")
    plan_models = {"measured": lora_model}  # what --plan reads: config.json
    if not lora_model:
        lora_model = plan_models["measured"] = tmp / "t5-base-shape"
        plan_models[f"vocab {T5_BASE_VOCAB}"] = tmp / "t5-base-vocab"
        if not args.dry_run:
            log(f"Writing a t5-base-shaped random T5 (198M parameters, 0.79 GB; "
                f"tests/tiny_wikihow.py) to {lora_model}")
            write_fixture("t5-base-shaped T5", [
                "-c", "import json, sys; sys.path.insert(0, sys.argv[1]); import tiny_wikihow; "
                "tiny_wikihow.write_tiny_t5(sys.argv[2], **json.loads(sys.argv[3]))",
                REPO / "tests", lora_model, json.dumps(T5_BASE_SHAPE)])
            config_json = json.loads((lora_model / "config.json").read_text())
            (tmp / "t5-base-vocab").mkdir()
            (tmp / "t5-base-vocab" / "config.json").write_text(
                json.dumps({**config_json, "vocab_size": T5_BASE_VOCAB}))
    lora_source = (f"Model {lora_model}" if args.lora_model else
                   "Model: t5-base's shape with random weights and the tests' 232-token "
                   "vocabulary (tests/tiny_wikihow.py's write_tiny_t5, "
                   + ", ".join(f"{k} {v}" for k, v in T5_BASE_SHAPE.items()) + ")")
    lora_source += (f", WikiHow from {lora_data}" if args.wikihow_dir
                    else ", data the WikiHow-format fixture CSV of the tests")

if "hf-load" in args.only or "hf-export" in args.only:  # fixtures written once for both
    hf_data = wikihow_dir or tmp / "wikihow"
    hf_tiny, hf_shape = tmp / "hf-load-tiny-t5", tmp / "t5-base-shape"
    hf_models = {(dtype, way): tmp / f"t5-base-{dtype}-{HF_LOAD_WAYS[way].split('.')[-1]}"
                 for dtype in args.hf_load_dtypes for way in HF_LOAD_WAYS}
    hf_parameters = None
    if not args.dry_run:
        log(f"Writing the tiny T5{'' if hf_data.exists() else ' and WikiHow'} fixture "
            f"(tests/tiny_wikihow.py) to {tmp}")
        write_fixture("tiny T5", ["-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                                  "import tiny_wikihow; tiny_wikihow.write_tiny_t5(sys.argv[2]); "
                                  "sys.argv[3:] and tiny_wikihow.write_wikihow(sys.argv[3])",
                                  REPO / "tests", hf_tiny,
                                  *([] if hf_data.exists() else [hf_data])])
        if not wikihow_dir:
            env["HF_DATASETS_CACHE"] = str(tmp / "hf_datasets_cache")
        if not hf_shape.exists():  # --only lora writes the same, into the same folder
            log(f"Writing a t5-base-shaped random T5 (198M parameters, 0.79 GB; "
                f"tests/tiny_wikihow.py) to {hf_shape}")
            write_fixture("t5-base-shaped T5", [
                "-c", "import json, sys; sys.path.insert(0, sys.argv[1]); import tiny_wikihow; "
                "tiny_wikihow.write_tiny_t5(sys.argv[2], **json.loads(sys.argv[3]))",
                REPO / "tests", hf_shape, json.dumps(T5_BASE_SHAPE)])
        for dtype in args.hf_load_dtypes:
            log(f"Storing it in {dtype}, as safetensors and as a pytorch_model.bin "
                "(benchmarks/hf_memory.py)")
            info = tmp / f"t5-base-{dtype}.json"
            write_fixture(f"{dtype} t5-base-shaped T5", [
                REPO / "benchmarks" / "hf_memory.py", hf_shape, dtype,
                *(hf_models[(dtype, way)] for way in HF_LOAD_WAYS), info])
            hf_parameters = json.loads(info.read_text())["parameters"]

# ----------------------------------------------------------------------------------- configurations
# One entry per table row: which script, how many processes, on which device, with which flags.
configs = []
for device in ["cpu"] + (["cuda"] if gpu else []):
    on_cpu = device == "cpu"
    if "mnist" in args.only:
        for name, script, flags in [("DDP", "ddp_mnist.py", []),
                                    ("FSDP1 FULL_SHARD", "fsdp1_mnist.py", []),
                                    ("FSDP1 FULL_SHARD, auto-wrap 20000", "fsdp1_mnist.py",
                                     ["--auto-wrap-min-params", "20000"])]:
            configs.append({"benchmark": "mnist", "device": device,
                            "world_size": 2 if on_cpu else 1, "name": name,
                            "data_dir": mnist_dir, "script": script,
                            "args": ["--data-dir", str(mnist_dir),
                                     "--epochs", str(args.mnist_epochs), *flags,
                                     *(["--no-cuda"] if on_cpu else [])]})
    if "fsdp2" in args.only:
        for world_size in fsdp2_world_sizes if on_cpu else [1]:
            for name in args.fsdp2_options:
                configs.append({"benchmark": "fsdp2", "device": device,
                                "world_size": world_size, "name": name,
                                "script": "fsdp2_transformer.py",
                                "args": ["--steps", str(args.fsdp2_steps),
                                         "--batch-size", str(FSDP2_BATCH),
                                         "--seq-len", str(FSDP2_SEQ_LEN),
                                         "--log-every", str(args.fsdp2_steps),
                                         *FSDP2_OPTIONS[name], *(["--cpu"] if on_cpu else [])]})
    if "t5" in args.only:
        # On CPU, fp32 for every strategy (bf16 has no native units there): a like-for-like
        # comparison. At world size 1, FSDP1 runs every strategy as NO_SHARD, so on the GPU only
        # fp32 and bf16 are compared, for both FSDP versions.
        t5_runs = ([(*config, "fp32") for config in T5_CONFIGS] if on_cpu else
                [(version, "FULL_SHARD", "BACKWARD_PRE", precision)
                 for version in (1, 2) for precision in ("fp32", "bf16")])
        for version, strategy, prefetch, precision in t5_runs:
            configs.append({"benchmark": "t5", "device": device,
                            "world_size": 2 if on_cpu else 1, "fsdp_version": version,
                            "name": f"FSDP{version} {strategy} {prefetch} {precision}",
                            "strategy": strategy, "prefetch": prefetch, "precision": precision,
                            "script": "t5_fsdp_finetune.py",
                            "args": ["--model-name", str(t5_model), "--data-dir", str(wikihow_dir),
                                     "--epochs", str(args.t5_epochs), *T5_SIZES,
                                     "--fsdp-version", str(version),
                                     "--sharding-strategy", strategy,
                                     "--backward-prefetch", prefetch,
                                     "--mixed-precision", precision,
                                     "--no-save-model", *(["--cpu"] if on_cpu else [])]})

if "tp" in args.only:  # 4 ranks; on fewer cores, said under the header
    if cores < 4:
        notes.append(f"Tensor parallel on 4 ranks with {cores} CPU cores: the processes share "
                     "the cores, so tokens/s compares the layouts, not what 4 cores would do.")
    for tp in TP_DEGREES:
        configs.append({"benchmark": "tp", "device": "cpu", "world_size": 4, "tp": tp,
                        "name": f"dp {4 // tp} x tp {tp}", "script": "fsdp2_transformer.py",
                        "args": ["--steps", str(args.fsdp2_steps), "--batch-size",
                                 str(FSDP2_BATCH), "--seq-len", str(FSDP2_SEQ_LEN),
                                 "--log-every", str(args.fsdp2_steps), "--tp-degree", str(tp),
                                 "--cpu"]})

if "checkpoint" in args.only:
    checkpoint_runs = {name: ("fsdp2_transformer.py", flags)
                       for name, flags in CHECKPOINT_RUNS.items()}
    if args.thread_writer_script:
        checkpoint_runs["thread writer (--async-checkpoint, --thread-writer-script)"] = (
            os.path.abspath(args.thread_writer_script), [*CHECKPOINT_SAVES, "--async-checkpoint"])
    for name, (script, flags) in checkpoint_runs.items():
        configs.append({"benchmark": "checkpoint", "device": "cpu", "world_size": 2,
                        "name": name, "script": script,
                        "args": [*CHECKPOINT_MODEL, *flags, "--cpu"]})

if "fsdp2-gpu" in args.only:  # world size 1 on the first GPU; the checkpoints in the run's folder
    for name, flags in C1B_RUNS.items():
        saves = name.startswith("checkpoint")
        configs.append({"benchmark": "fsdp2-gpu", "device": "cuda", "world_size": 1,
                        "name": name, "script": "fsdp2_transformer.py",
                        "args": [*C1B, *flags, "--steps", "201" if saves else "40",
                                 "--log-every", "10",
                                 *(["--checkpoint-dir", "ckpt"] if saves else [])]})

if "lora" in args.only:  # world size 2 on CPU; the rows take turns
    lora_runs = [(row, version, None, "t5_fsdp_finetune.py") for row in LORA_ROWS
                 for version in (1, 2)]
    for option in args.lora_adamw:
        script = adamw_copy(tmp / f"adamw-{option}", option)
        if script is None:
            log(f"error: t5_fsdp_finetune.py has no single optim.AdamW(...) line ending in "
                f"{ADAMW_LINE_END!r} any more: update ADAMW_LINE_END in benchmarks/run.py, or "
                "pass --lora-adamw with nothing")
            sys.exit(1)
        lora_runs += [("full fine-tuning", version, option, str(script)) for version in (1, 2)]
    for row, version, adamw, script in lora_runs:
        configs.append({"benchmark": "lora", "device": "cpu", "world_size": 2,
                        "name": f"{row}, FSDP{version}"
                        + (f", AdamW({adamw}=True)" if adamw else ""),
                        "row": row, "fsdp_version": version, "adamw": adamw,
                        "samples": LORA_TRAIN_SAMPLES,
                        "curve": f"{row}, FSDP{version} FULL_SHARD", "script": script,
                        "args": ["--model-name", str(lora_model), "--data-dir", str(lora_data),
                                 *LORA_SIZES, *LORA_RUN, *LORA_ROWS[row],
                                 "--fsdp-version", str(version)]})
    # The picture's and the table's plans: every curve at every world size, each model
    plan_keys = [(model, curve, world_size) for model in plan_models for curve in LORA_CURVES
                 for world_size in PLAN_WORLD_SIZES]
    plan_argvs = [["--plan", "--world-size", str(world_size), "--model-name",
                   str(plan_models[model]), *LORA_SIZES, *LORA_CURVES[curve]]
                  for model, curve, world_size in plan_keys]

if "lora-gpu" in args.only:  # world size 1 on the first GPU
    for row in LORA_ROWS:
        for version in (1, 2):
            configs.append({"benchmark": "lora-gpu", "device": "cuda", "world_size": 1,
                            "name": f"{row}, FSDP{version}", "row": row,
                            "fsdp_version": version, "samples": LORA_GPU_SAMPLES,
                            "script": "t5_fsdp_finetune.py",
                            "args": ["--model-name", str(lora_model), "--data-dir",
                                     str(lora_data), *LORA_GPU_SIZES,
                                     "--num-train-samples", str(LORA_GPU_SAMPLES),
                                     "--epochs", str(LORA_GPU_EPOCHS), "--no-run-validation",
                                     "--no-save-model", *LORA_ROWS[row],
                                     "--fsdp-version", str(version)]})

if "hf-load" in args.only:  # CPU; per world size the tiny T5 (the baseline), then the model's rows
    for world_size in HF_LOAD_WORLD_SIZES:
        rows = [("tiny", "shard by shard", hf_tiny)] + [
            (dtype, way, hf_models[(dtype, way)]) for dtype in args.hf_load_dtypes
            for way in HF_LOAD_WAYS]
        for dtype, way, model_dir in rows:
            configs.append({"benchmark": "hf-load", "device": "cpu", "world_size": world_size,
                            "name": (f"tiny T5 (baseline), {way}" if dtype == "tiny" else
                                     f"t5-base's shape stored in {dtype}, {way}"),
                            "dtype": dtype, "way": way, "repeats": args.hf_load_repeats,
                            "script": "t5_fsdp_finetune.py",
                            "args": ["--model-name", str(model_dir), "--data-dir", str(hf_data),
                                     *HF_LOAD_RUN]})


if "hf-export" in args.only:  # CPU; the model stored in the first dtype, as safetensors
    for world_size in HF_LOAD_WORLD_SIZES:
        for way, flags in HF_EXPORT_WAYS.items():
            configs.append({"benchmark": "hf-export", "device": "cpu", "world_size": world_size,
                            "name": way, "way": way, "repeats": args.hf_load_repeats,
                            "script": "t5_fsdp_finetune.py",
                            "args": ["--model-name",
                                     str(hf_models[(args.hf_load_dtypes[0], "shard by shard")]),
                                     "--data-dir", str(hf_data), *HF_EXPORT_RUN, *flags]})


if "cpu-memory" in args.only:  # world size 2 on CPU; the rows take turns
    t5_run = ["--data-dir", str(wikihow_dir), "--no-save-model", "--cpu"]
    lora_run = ["--model-name", str(lora_model), "--data-dir", str(lora_data), *LORA_SIZES,
                *LORA_RUN, *LORA]
    memory_rows = {
        "MNIST, DDP": ("ddp_mnist.py", ["--data-dir", str(mnist_dir), "--epochs", "1", "--cpu"]),
        "MNIST, FSDP1": ("fsdp1_mnist.py", ["--data-dir", str(mnist_dir), "--epochs", "1",
                                            "--cpu"]),
        "FSDP2, its defaults": ("fsdp2_transformer.py", ["--cpu"]),
        "T5, tiny, FSDP1": ("t5_fsdp_finetune.py", ["--model-name", str(t5_model), *t5_run,
                                                    *T5_SIZES]),
        "T5, t5-base's shape, LoRA, FSDP1": ("t5_fsdp_finetune.py", lora_run),
        "T5, t5-base's shape, LoRA, FSDP2": ("t5_fsdp_finetune.py", [*lora_run,
                                                                     "--fsdp-version", "2"])}
    for row, (script, flags) in memory_rows.items():
        for way, way_flags in CPU_MEMORY_WAYS.items():
            configs.append({"benchmark": "cpu-memory", "device": "cpu", "world_size": 2,
                            "name": f"{row}, {way}", "row": row, "way": way, "script": script,
                            "args": [*flags, *way_flags]})


if "lengths" in args.only:  # world size 2 on CPU; the ways take turns
    lengths_data = {LENGTHS_T5_DATA[0]: lora_data, LENGTHS_T5_DATA[1]: tmp / "wikihow-lengths"}
    if not args.dry_run:
        log(f"Writing WikiHow-like lengths (benchmarks/wikihow_lengths.py) to "
            f"{lengths_data[LENGTHS_T5_DATA[1]]}")
        write_fixture("WikiHow-like lengths", [REPO / "benchmarks" / "wikihow_lengths.py",
                                               lengths_data[LENGTHS_T5_DATA[1]]])
    for data, folder in lengths_data.items():
        for way, flags in LENGTHS_T5_WAYS.items():
            configs.append({"benchmark": "lengths", "device": "cpu", "world_size": 2,
                            "name": f"T5, {data}, {way}", "row": f"T5, {data}", "way": way,
                            "samples": 4, "script": "t5_fsdp_finetune.py",
                            "args": ["--model-name", str(lora_model), "--data-dir", str(folder),
                                     *LENGTHS_T5, *flags]})
    for way, flags in LENGTHS_FSDP2_WAYS.items():
        configs.append({"benchmark": "lengths", "device": "cpu", "world_size": 2,
                        "name": f"fsdp2, {way}", "row": "fsdp2", "way": way,
                        "script": "fsdp2_transformer.py", "args": [*LENGTHS_FSDP2, *flags]})

if "fault-tolerance" in args.only:  # 4 processes on CPU; the ways take turns
    for way, (flags, start, victim) in FT_WAYS.items():
        configs.append({"benchmark": "fault-tolerance", "device": "cpu", "world_size": 4,
                        "name": way, "way": way, "script": "fsdp2_transformer.py",
                        "args": [*FT_RUN, *flags], "victim": victim, **start})


def command_of(config, metrics_path):
    script = [str(REPO / config["script"]), *config["args"], "--metrics-json", str(metrics_path)]
    if config.get("python"):  # the script starts its processes (torchft's replica groups)
        return [sys.executable, *script]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(config["world_size"]), *config.get("torchrun_flags", []),
            *script]


if args.dry_run:
    for config in configs:
        print(shlex.join(command_of(config, "metrics.json")))
    for model, curve in dict.fromkeys(key[:2] for key in plan_keys) if "lora" in args.only else ():
        sizes = " ".join(map(str, PLAN_WORLD_SIZES))  # one line per curve, not 7
        print(shlex.join(["python", str(REPO / "t5_fsdp_finetune.py"), "--plan", "--world-size",
                          "N", "--model-name", str(plan_models[model]), *LORA_SIZES,
                          *LORA_CURVES[curve]]) + f"  # N in {sizes}")
    shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(0)

if "lora" in args.only:  # before the runs: a --plan that fails, fails in seconds
    log(f"--plan for {len(plan_argvs)} configurations (benchmarks/t5_memory.py)")
    (tmp / "plan-runs.json").write_text(json.dumps(plan_argvs))
    proc = subprocess.run([sys.executable, REPO / "benchmarks" / "t5_memory.py",
                           REPO / "t5_fsdp_finetune.py", tmp / "plan-runs.json",
                           tmp / "plans.json"], cwd=tmp, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        log(f"error: --plan failed:\n{stderr_tail(proc.stderr)}")
        sys.exit(1)
    lora_plans = dict(zip(plan_keys, json.loads((tmp / "plans.json").read_text())))

# --------------------------------------------------------------------------------------------- runs
runs, failures = [], []
for config in configs:
    config["figures"], config["failed"] = [], False  # one dict per successful run
    config.setdefault("repeats", args.repeats)  # hf-load's: --hf-load-repeats
total = sum(config["repeats"] for config in configs)
# The checkpoint and lora rows take turns (each configuration once, then again); the others run
# in a row.
TURNS = ("checkpoint", "lora", "lora-gpu", "cpu-memory", "lengths", "fault-tolerance")
schedule = [(config, repeat) for repeat in range(1, args.repeats + 1) for config in configs
            if config["benchmark"] in TURNS]
schedule += [(config, repeat) for config in configs if config["benchmark"] not in TURNS
             for repeat in range(1, config["repeats"] + 1)]
if {"hf-load", "hf-export", "cpu-memory"} & set(args.only):
    sys.path.insert(0, str(REPO / "benchmarks"))
    from hf_memory import RETURN_FREED, rss_anon_peaks
for config, repeat in schedule:
    if not config["failed"]:
        # Whatever a script writes lands in its own folder.
        workdir = Path(tempfile.mkdtemp(prefix="run-", dir=tmp))
        metrics_path = workdir / "metrics.json"
        command = command_of(config, metrics_path)
        label = (f"{config['benchmark']} {config['device']} world size {config['world_size']} "
                 f"{config['name']}")
        log(f"[{len(runs) + 1}/{total}] {label}, run {repeat}/{config['repeats']}")
        run_start, cpu_start = time.perf_counter(), cpu_seconds_of_children()
        finished, writers = threading.Event(), {}
        watching = threading.Thread(target=watch_writers, args=(workdir, finished, writers))
        if config["benchmark"] == "checkpoint":  # the others have no writer to watch
            watching.start()
        if config["benchmark"] == "hf-load":  # RssAnon of each rank, sampled every 10 ms
            returncode, stdout, stderr, rank_peaks, loaded, _ = rss_anon_peaks(
                command, workdir, HF_LOAD_UNTIL, env=env, timeout=args.timeout)
        elif config["benchmark"] == "cpu-memory":  # the whole run; T5's from after loading
            returncode, stdout, stderr, rank_peaks, _, rank_bases = rss_anon_peaks(
                command, workdir, "\0", env=env, timeout=args.timeout,
                start=CPU_MEMORY_LOADED if "t5" in config["script"] else None)
        elif config["benchmark"] == "hf-export":  # from the line before the export
            returncode, stdout, stderr, rank_peaks, saved, rank_bases = rss_anon_peaks(
                command, workdir, HF_EXPORT_UNTIL, env={**env, **RETURN_FREED},
                timeout=args.timeout, start=HF_EXPORT_FROM)
        elif config["benchmark"] == "fault-tolerance":
            returncode, stdout, stderr, kill_figures = kill_and_time(
                command, workdir, config["victim"], env=env, timeout=args.timeout)
            if config.get("python"):  # each replica group's metrics: group 0's
                metrics_path = workdir / "metrics.group0.json"
        else:
            proc = subprocess.Popen(command, cwd=workdir, env=env, text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            try:
                stdout, stderr = proc.communicate(timeout=args.timeout)
            except subprocess.TimeoutExpired:
                proc.terminate()  # torchrun passes SIGTERM on to its workers
                stdout, stderr = proc.communicate()
                stderr += f"\nharness: killed after --timeout {args.timeout} s"
            returncode = proc.returncode
        finished.set()
        if watching.is_alive():
            watching.join()
        run = {"benchmark": config["benchmark"], "device": config["device"],
               "world_size": config["world_size"], "name": config["name"], "repeat": repeat,
               "command": command, "returncode": returncode,
               "seconds": time.perf_counter() - run_start, "metrics": None, "figures": None,
               # every process of the run, reaped ones (torchrun waits for its workers, each
               # worker for its writer): user + system
               "cpu_s": cpu_seconds_of_children() - cpu_start,
               "writers_cpu_s": sum(writers.values())}
        runs.append(run)
        error = None
        if returncode != 0 or not metrics_path.exists():
            error = (f"exit status {returncode}"
                     + ("" if returncode else " but no metrics file"))
        else:
            metrics = run["metrics"] = json.loads(metrics_path.read_text())
            # A script that fell back to another device would put its figures in the wrong table.
            ran_on = (metrics.get("device"), metrics.get("world_size"))
            if ran_on != (config["device"], config.get("metrics_world_size",
                                                       config["world_size"])):
                error = (f"it ran on {ran_on[0]} at world size {ran_on[1]}, "
                         f"not on {config['device']} at world size {config['world_size']}")
            else:
                try:
                    run["figures"] = figures_of(config, metrics, stdout)
                    if config["benchmark"] == "checkpoint":
                        run["figures"].update(cpu_s=run["cpu_s"],
                                              writers_cpu_s=run["writers_cpu_s"])
                    if config["benchmark"] == "hf-load":
                        run["figures"].update(hf_load_figures(config, stdout, rank_peaks, loaded))
                    if config["benchmark"] == "fault-tolerance":
                        run["figures"].update(kill_figures)
                    if config["benchmark"] == "cpu-memory":
                        if sorted(rank_peaks) != list(range(config["world_size"])):
                            raise ValueError(f"RssAnon was sampled for ranks {sorted(rank_peaks)}")
                        run["figures"].update(
                            rss_anon_mib=max(rank_peaks.values()) / MIB,
                            above_loaded_mib=max(rank_peaks[rank] - base for rank, base in
                                                 rank_bases.items()) / MIB
                            if "t5" in config["script"] else None)
                    if config["benchmark"] == "hf-export":
                        if not saved or sorted(rank_bases) != list(range(config["world_size"])):
                            raise ValueError(f"no {HF_EXPORT_UNTIL!r} line, or ranks unsampled")
                        run["figures"].update({f"rank{rank}_mib": (rank_peaks[rank] - base) / MIB
                                               for rank, base in sorted(rank_bases.items())})
                except KeyError as e:
                    error = f"its metrics file has no {e} (has the script changed?)"
                except ValueError as e:
                    error = str(e)
        if error:
            run["error"], run["stderr_tail"] = error, stderr_tail(stderr)
            failures.append(run)
            log(f"\nFAILED: {label}, run {repeat}/{config['repeats']}, {error}\n"
                f"command: {shlex.join(command)}\n"
                f"--- end of its stderr ---\n{run['stderr_tail']}\n"
                "--- the remaining runs of this configuration are skipped ---\n")
            config["failed"] = True
            continue
        config["figures"].append(run["figures"])
        shutil.rmtree(workdir)  # C1B's checkpoints (37.5 GB a run) would fill the disk by the next
        log(f"    {run['seconds']:.1f} s: "
            + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                        for k, v in run["figures"].items()))

# ------------------------------------------------------------------------------------------- tables


def median(config, key):
    """The median over a configuration's runs.

    None when it was not run or failed, or a run lacks the figure.
    """
    if config is None or config["failed"]:
        return None
    values = [f[key] for f in config["figures"]]
    return None if None in values else statistics.median(values)


def find(benchmark, device, **fields):
    return next((c for c in configs if c["benchmark"] == benchmark and c["device"] == device
                 and all(c.get(k) == v for k, v in fields.items())), None)


machine = (f"{cpu_model()}, {cores} CPU cores, {platform.system()} {platform.machine()}, Python "
           f"{platform.python_version()}, torch {torch.__version__}"
           + (f", GPU: {torch.cuda.get_device_name(0)} (CUDA {torch.version.cuda})" if gpu
              else ", no GPU used"))
threads = (f"OMP_NUM_THREADS={os.environ['OMP_NUM_THREADS']}" if "OMP_NUM_THREADS" in os.environ
           else "OMP_NUM_THREADS unset (torchrun sets 1 per process when it starts more than one; "
                "one process uses every core)")
runs_said = f"median of {args.repeats} run{'s' if args.repeats > 1 else ''}"
if args.smoke:
    runs_said += " (SMOKE RUN, not figures to quote)"
out = [f"Measured on: {machine}; {threads}.",
       f"Command: `{shlex.join(['python', 'benchmarks/run.py', *sys.argv[1:]])}`.",
       f"Every figure is the {runs_said} of the configuration. Epoch time: per run, the median "
       "of the epochs after the first; then the median over runs. Memory per rank is the maximum "
       "over ranks."]
if "hf-load" in args.only:  # its own count of runs, and memory for each rank
    hf_load_said = (f"hf-load: {args.hf_load_repeats} run{'s' if args.hf_load_repeats > 1 else ''}"
                    " per configuration (--hf-load-repeats), each rank's memory shown.")
    out[2] = hf_load_said if set(args.only) == {"hf-load"} else out[2] + " " + hf_load_said
out += notes
peak_label = {"cpu": "peak RSS / rank (MiB)", "cuda": "peak CUDA allocated (MiB)"}
for device in ["cpu"] + (["cuda"] if gpu else []):
    where = "CPU, gloo" if device == "cpu" else "GPU, NCCL, world size 1"
    if "mnist" in args.only:
        ddp = find("mnist", device, name="DDP")
        headers = (["configuration", "world size", "train state / rank (MiB)", "state vs DDP",
                    peak_label[device], "epoch time (s)", "time vs DDP", "train samples/s"]
                   + (["CUDA-event time, all epochs (s)"] if device == "cuda" else []))
        rows = []
        for c in configs:
            if c["benchmark"] != "mnist" or c["device"] != device:
                continue
            rows.append([c["name"] + (" (FAILED)" if c["failed"] else ""), c["world_size"],
                         fmt(median(c, "state_mib"), ".3f"),
                         fmt(ratio(median(c, "state_mib"), median(ddp, "state_mib")), ".2f"),
                         fmt(median(c, "peak_mib"), ".1f"), fmt(median(c, "epoch_s"), ".3f"),
                         fmt(ratio(median(c, "epoch_s"), median(ddp, "epoch_s")), ".2f"),
                         fmt(median(c, "samples_per_s"), ",.0f")]
                        + ([fmt(median(c, "cuda_event_s"), ".3f")] if device == "cuda" else []))
        out += [f"\n### MNIST: DDP vs FSDP1 ({where})\n",
                f"{mnist_source}; batch size 64 per rank, {args.mnist_epochs} epochs, Adadelta; "
                f"{runs_said}. Epoch time includes the test pass; train samples/s = training "
                "samples of an epoch / epoch time."
                + (" At world size 1 FSDP1 runs FULL_SHARD as NO_SHARD: nothing is sharded."
                   if device == "cuda" else "")
                + "\n",
                markdown_table(headers, rows)]
    if "fsdp2" in args.only:
        headers = ["world size", "options", "train state / rank (MiB)", "state vs world size 1",
                   "ideal 1/N", peak_label[device], "time / step (ms)", "tokens/s",
                   "tokens/s vs plain"]
        rows = []
        for c in configs:
            if c["benchmark"] != "fsdp2" or c["device"] != device:
                continue
            single = find("fsdp2", device, world_size=1, name=c["name"])
            plain = find("fsdp2", device, world_size=c["world_size"], name="plain")
            rows.append([c["world_size"], c["name"] + (" (FAILED)" if c["failed"] else ""),
                         fmt(median(c, "state_mib"), ".3f"),
                         fmt(ratio(median(c, "state_mib"), median(single, "state_mib")), ".3f"),
                         f"{1 / c['world_size']:.3f}", fmt(median(c, "peak_mib"), ".1f"),
                         fmt(median(c, "step_ms"), ".2f"), fmt(median(c, "tokens_per_s"), ",.0f"),
                         fmt(ratio(median(c, "tokens_per_s"), median(plain, "tokens_per_s")),
                             ".2f")])
        out += [f"\n### FSDP2: fully_shard on the small Transformer ({where})\n",
                f"Default model (vocab 128, dim 64, 2 layers, 4 heads), global batch {FSDP2_BATCH} "
                f"x {FSDP2_SEQ_LEN} tokens, {args.fsdp2_steps} steps; {runs_said}. tokens/s and "
                "time / step cover every step, the first included; mixed-precision is bf16 "
                "compute with fp32 reduction"
                + (" (slower on CPUs without native bf16)" if device == "cpu"
                   else "; its tokens/s vs plain is the bf16 speed-up")
                + ".\n",
                markdown_table(headers, rows)]
    if "tp" in args.only and device == "cpu":
        fsdp = find("tp", "cpu", tp=1)
        headers = ["mesh (dp x tp)", "train state / rank (MiB)", "state vs dp 4",
                   peak_label[device], "time / step (ms)", "tokens/s", "tokens/s vs dp 4"]
        rows = [[c["name"] + (" (FAILED)" if c["failed"] else ""),
                 fmt(median(c, "state_mib"), ".3f"),
                 fmt(ratio(median(c, "state_mib"), median(fsdp, "state_mib")), ".3f"),
                 fmt(median(c, "peak_mib"), ".1f"), fmt(median(c, "step_ms"), ".2f"),
                 fmt(median(c, "tokens_per_s"), ",.0f"),
                 fmt(ratio(median(c, "tokens_per_s"), median(fsdp, "tokens_per_s")), ".2f")]
                for c in configs if c["benchmark"] == "tp"]
        out += ["\n### Tensor parallel: FSDP2 + --tp-degree on 4 ranks (CPU, gloo)\n",
                f"Default model (vocab 128, dim 64, 2 layers, 4 heads), global batch "
                f"{FSDP2_BATCH} x {FSDP2_SEQ_LEN} tokens, {args.fsdp2_steps} steps; {runs_said}. "
                "dp 4 x tp 1 is plain FSDP2; tp T splits each layer over T ranks, which read the "
                "same rows, and FSDP2 shards over the 4 / T others.\n",
                markdown_table(headers, rows)]
    if "t5" in args.only:
        base = find("t5", device, fsdp_version=1, strategy="FULL_SHARD", prefetch="BACKWARD_PRE",
                    precision="fp32")
        no_shard = find("t5", device, fsdp_version=1, strategy="NO_SHARD",
                        prefetch="BACKWARD_PRE", precision="fp32")
        headers = ["FSDP", "sharding strategy", "backward prefetch", "precision", "world size",
                   "train state / rank (MiB)", "state vs NO_SHARD", peak_label[device],
                   "epoch time (s)", "train samples/s",
                   "samples/s vs FSDP1 FULL_SHARD BACKWARD_PRE fp32"]
        rows = []
        for c in configs:
            if c["benchmark"] != "t5" or c["device"] != device:
                continue
            used = sorted({f["precision_used"] for f in c["figures"]})
            precision = c["precision"] + ("" if used in ([], [c["precision"]])
                                          else f" (ran as {'/'.join(used)})")
            rows.append([c["fsdp_version"], c["strategy"] + (" (FAILED)" if c["failed"] else ""),
                         c["prefetch"],
                         precision, c["world_size"], fmt(median(c, "state_mib"), ".3f"),
                         fmt(ratio(median(c, "state_mib"), median(no_shard, "state_mib")), ".2f"),
                         fmt(median(c, "peak_mib"), ".1f"), fmt(median(c, "epoch_s"), ".3f"),
                         fmt(median(c, "samples_per_s"), ",.1f"),
                         fmt(ratio(median(c, "samples_per_s"), median(base, "samples_per_s")),
                             ".2f")])
        out += [f"\n### T5 fine-tuning: FSDP1 and FSDP2, sharding strategies, backward prefetch "
                f"({where})\n",
                f"{t5_source}; input 64 and output 24 tokens, 128 training and 31 validation "
                f"articles, batch size 4 per rank, {args.t5_epochs} epochs, --no-save-model; "
                f"{runs_said}. Epoch time includes validation; train samples/s is the script's "
                "samples_per_s (training time of every epoch, validation excluded).\n",
                markdown_table(headers, rows)]

if "checkpoint" in args.only:
    none, synchronous = (find("checkpoint", "cpu", name=name) for name in list(CHECKPOINT_RUNS)[:2])
    headers = ["configuration", "tokens/s (steady)", "vs no checkpoints",
               "tokens/s (all steps and pauses)", "vs no checkpoints", "first save's pause (s)",
               "vs synchronous", "later saves' pause, median (s)", "vs synchronous",
               "CPU s, every process", "of which writers"]
    rows = []
    for c in (c for c in configs if c["benchmark"] == "checkpoint"):
        rows.append([c["name"] + (" (FAILED)" if c["failed"] else ""),
                     fmt(median(c, "tokens_per_s"), ",.1f"),
                     fmt(ratio(median(c, "tokens_per_s"), median(none, "tokens_per_s")), ".2f"),
                     fmt(median(c, "all_in_tokens_per_s"), ",.1f"),
                     fmt(ratio(median(c, "all_in_tokens_per_s"),
                               median(none, "all_in_tokens_per_s")), ".2f")]
                    + [value for key in ("first_pause_s", "later_pause_s") for value in (
                        fmt(median(c, key), ".3f"),
                        fmt(ratio(median(c, key), median(synchronous, key)), ".3f"))]
                    + [fmt(median(c, "cpu_s"), ".1f"), fmt(median(c, "writers_cpu_s"), ".1f")])
    out += ["\n### Checkpoint pauses: synchronous, thread and process writers (CPU, gloo)\n",
            f"`{' '.join(CHECKPOINT_MODEL)}` on 2 ranks, saves `{' '.join(CHECKPOINT_SAVES)}`; "
            f"{runs_said}, the configurations taking turns. tokens/s (steady) is the script's "
            "(the median step, pauses left out); tokens/s (all) counts every step after the first "
            "and every pause. A pause is how long a save stopped training, the wait of the next "
            "step for its copy included. CPU s: user + system seconds of the whole run, every "
            "process (start-up included), and of the checkpoint writer processes alone.\n",
            markdown_table(headers, rows)]

if "fsdp2-gpu" in args.only:
    headers = ["configuration", "tokens/s", "vs upstream example", "TFLOP/s", "MFU",
               peak_label["cuda"], "first save's pause (s)", "later save's pause (s)"]
    rows = [[c["name"] + (" (FAILED)" if c["failed"] else ""),
             fmt(median(c, "tokens_per_s"), ",.0f"),
             fmt(ratio(median(c, "tokens_per_s"), UPSTREAM_C1B_TOKENS_PER_S), ".3f"),
             fmt(median(c, "tflops"), ".1f"), fmt(median(c, "mfu"), ".1%"),
             fmt(median(c, "peak_mib"), ",.0f"), fmt(median(c, "first_pause_s"), ".2f"),
             fmt(median(c, "later_pause_s"), ".2f")]
            for c in configs if c["benchmark"] == "fsdp2-gpu"]
    out += ["\n### FSDP2 at scale: C1B on one GPU\n",
            f"`{' '.join(C1B)}` (1,041,640,704 parameters), world size 1; {runs_said}. tokens/s, "
            "TFLOP/s and MFU are the script's steady state (the first step, and the first two "
            "with --compile, and checkpoint pauses left out); the upstream example "
            f"(pytorch/examples distributed/FSDP2, same sizes and loss) ran at "
            f"{UPSTREAM_C1B_TOKENS_PER_S:,} tokens/s on an H100 (issue 19). A pause is how long "
            "training stopped for a save; the later one is the save at step 200's, step 201's "
            "wait for its copy included.\n", markdown_table(headers, rows)]

if "lora" in args.only:
    full = {version: find("lora", "cpu", row="full fine-tuning", fsdp_version=version, adamw=None)
            for version in (1, 2)}
    parameters = lora_plans[("measured", next(iter(LORA_CURVES)), 1)]["parameters"]
    headers = ["configuration", "FSDP", "train state / rank (MiB)", "vs full FSDP1",
               "--plan's train state (MiB)", "RSS after loading / rank (MiB)",
               "peak RSS / rank (MiB)", "vs full FSDP1", "train samples/s", "vs full FSDP1"]
    rows = []
    for c in (c for c in configs if c["benchmark"] == "lora" and not c["adamw"]):
        planned = lora_plans[("measured", c["curve"], 2)]["train_state_bytes"] / MIB
        rows.append([c["row"] + (" (FAILED)" if c["failed"] else ""), c["fsdp_version"],
                     fmt(median(c, "state_mib"), ".1f"),
                     fmt(ratio(median(c, "state_mib"), median(full[1], "state_mib")), ".3f"),
                     f"{planned:.1f}", fmt(median(c, "loaded_mib"), ".0f"),
                     fmt(median(c, "peak_mib"), ".0f"),
                     fmt(ratio(median(c, "peak_mib"), median(full[1], "peak_mib")), ".2f"),
                     fmt(median(c, "samples_per_s"), ".3f"),
                     fmt(ratio(median(c, "samples_per_s"), median(full[1], "samples_per_s")),
                         ".2f")])
    out += ["\n### T5: LoRA against full fine-tuning, FSDP1 and FSDP2 (CPU, gloo)\n",
            f"{lora_source}: {parameters:,} parameters. World size 2, `{' '.join(LORA_SIZES)} "
            f"{' '.join(LORA_RUN)}`; LoRA `{' '.join(LORA)}` on q,v (alpha 16, dropout 0.05), the "
            f"bf16 base with `--base-dtype bf16`; {runs_said}, the configurations taking turns. "
            "Each epoch is one optimizer step of 4 articles per rank; train samples/s is "
            f"{LORA_TRAIN_SAMPLES} / the median epoch after the first. --plan's train state is "
            "what `--plan` predicts for the same flags; RSS after loading is each rank's peak "
            "once the model is loaded and sharded, before training.\n",
            markdown_table(headers, rows)]
    if args.lora_adamw:
        headers = ["FSDP", "AdamW", "time / step (s)", "train samples/s",
                   "vs FSDP1, default AdamW", "vs FSDP1, same AdamW",
                   "vs the same FSDP, default AdamW", "peak RSS / rank (MiB)"]
        rows = []
        for version in (1, 2):
            for adamw in (None, *args.lora_adamw):
                c, fsdp1 = (find("lora", "cpu", row="full fine-tuning", fsdp_version=v,
                                 adamw=adamw) for v in (version, 1))
                rows.append([version, ("default (on CPU: one tensor at a time)" if adamw is None
                                       else f"{adamw}=True")
                             + (" (FAILED)" if c["failed"] else ""),
                             fmt(median(c, "epoch_s"), ".2f"),
                             fmt(median(c, "samples_per_s"), ".3f")]
                            + [fmt(ratio(median(c, "samples_per_s"),
                                         median(baseline, "samples_per_s")), ".2f")
                               for baseline in (full[1], fsdp1, full[version])]
                            + [fmt(median(c, "peak_mib"), ".0f")])
        out += ["\n### T5: FSDP2 against FSDP1, and AdamW's foreach and fused (CPU, gloo)\n",
                "Full fine-tuning, as in the table above; the foreach and fused rows run a copy of "
                "t5_fsdp_finetune.py (written into the harness's temporary folder) whose "
                "`optim.AdamW(...)` also passes `foreach=True` or `fused=True`. A step is one "
                f"epoch (the median after the first); {runs_said}, all rows taking turns.\n",
                markdown_table(headers, rows)]
    if args.lora_plot:
        curves = []
        for model, width, dots in (("measured", 2, None), (f"vocab {T5_BASE_VOCAB}", 1, ":")):
            if model not in plan_models:
                continue
            for curve in LORA_CURVES:
                plans = [lora_plans[(model, curve, n)] for n in PLAN_WORLD_SIZES]
                colour = next(v for k, v in reversed(CURVE_COLOURS.items()) if k in curve)
                curves.append({"label": curve, "colour": colour, "linewidth": width,
                               "linestyle": dots or ("--" if "FSDP2" in curve else "-"),
                               "in_legend": model == "measured", "world_sizes": PLAN_WORLD_SIZES,
                               "train_state": [plan["train_state_bytes"] for plan in plans],
                               "peak": [plan["peak_bytes"] for plan in plans]})
        if len(plan_models) > 1:  # the dotted lines' legend entry
            vocab = lora_plans[(f"vocab {T5_BASE_VOCAB}", next(iter(LORA_CURVES)), 1)]
            curves.append({"label": f"dotted: t5-base's own {T5_BASE_VOCAB:,}-token vocabulary "
                           f"({vocab['parameters'] / 1e6:.1f}M parameters)", "colour": "gray",
                           "linestyle": ":", "linewidth": 1, "world_sizes": [],
                           "train_state": [], "peak": []})
        measured = [{"label": c["name"], "colour": curve["colour"], "world_size": 2,
                     "train_state": median(c, "state_mib") * MIB,
                     "peak": median(c, "peak_mib") * MIB}
                    for c in configs if c["benchmark"] == "lora" and not c["adamw"]
                    and median(c, "state_mib") is not None
                    for curve in curves if curve["label"] == c["curve"]]
        sys.path.insert(0, str(REPO / "benchmarks"))
        from t5_memory import draw
        shape = Path(str(lora_model)).name if args.lora_model else "t5-base's shape"
        try:  # a picture that fails must not take the tables of the runs with it
            draw(args.lora_plot,
                 f"T5, {shape} ({parameters / 1e6:.1f}M parameters): memory per rank, AdamW, "
                 "fp32 compute, batch 4 x (64 + 24) tokens per rank",
                 curves, measured,
                 note="Lines: the script's --plan at each world size (the training state exact, "
                      "the peak an estimate of the device memory training needs). FULL_SHARD "
                      "and SHARD_GRAD_OP, FSDP1 and FSDP2 hold the same training state: their "
                      "lines lie on each other (FSDP2's pads each tensor: a little more at 32-64 "
                      "ranks). Markers: measured at world size 2 on CPU, where the peak RSS also "
                      "holds Python, torch and the whole model each rank loads before sharding.")
        except Exception as e:
            log(f"error: the picture {args.lora_plot} could not be drawn: {e!r}")
            failures.append({"benchmark": "lora", "device": "cpu", "world_size": "1-64",
                             "name": "picture", "repeat": "-", "error": repr(e)})
        link = os.path.relpath(args.lora_plot, Path(args.out).parent if args.out else ".")
        out += [f"\n![Memory per rank against world size: --plan's curves and the measured runs]"
                f"({link})\n"]

if "lora-gpu" in args.only:
    full = find("lora-gpu", "cuda", row="full fine-tuning", fsdp_version=1)
    headers = ["configuration", "FSDP", "train state (MiB)", "vs full FSDP1",
               "peak CUDA allocated (MiB)", "vs full FSDP1", "train samples/s", "vs full FSDP1"]
    rows = [[c["row"] + (" (FAILED)" if c["failed"] else ""), c["fsdp_version"]]
            + [cell for key, form in (("state_mib", ".1f"), ("peak_mib", ".0f"),
                                      ("samples_per_s", ".1f"))
               for cell in (fmt(median(c, key), form),
                            fmt(ratio(median(c, key), median(full, key)), ".3f"))]
            for c in configs if c["benchmark"] == "lora-gpu"]
    out += ["\n### T5: LoRA against full fine-tuning on one GPU (NCCL, world size 1)\n",
            f"{lora_source}. `{' '.join(LORA_GPU_SIZES)} --num-train-samples "
            f"{LORA_GPU_SAMPLES} --epochs {LORA_GPU_EPOCHS} --no-run-validation`; LoRA "
            f"`{' '.join(LORA)}` on q,v, the bf16 base with `--base-dtype bf16`; {runs_said}, "
            "the configurations taking turns. Train samples/s is "
            f"{LORA_GPU_SAMPLES} / the median epoch after the first.\n",
            markdown_table(headers, rows)]

if "hf-export" in args.only:
    model_mib = 4 * hf_parameters / MIB if hf_parameters else None  # fp32, as the script trains
    headers = ["world size", "way", "RssAnon added while exporting, per rank (MiB)",
               "per rank, in models", "max, in models",
               f"target: model / N + {HF_LOAD_TARGET:.0%} of it, in models", "within target"]
    rows = []
    for c in (c for c in configs if c["benchmark"] == "hf-export"):
        added = [median(c, f"rank{rank}_mib") for rank in range(c["world_size"])]
        most = None if None in added else max(added)
        target = model_mib * (1 / c["world_size"] + HF_LOAD_TARGET) if model_mib else None
        rows.append([c["world_size"], c["way"] + (" (FAILED)" if c["failed"] else ""),
                     " / ".join(fmt(a, ".0f") for a in added),
                     " / ".join(fmt(ratio(a, model_mib), ".2f") for a in added),
                     fmt(ratio(most, model_mib), ".2f"), fmt(ratio(target, model_mib), ".2f"),
                     "n/a" if most is None or not target else "yes" if most <= target else "no"])
    out += ["\n### T5 at t5-base's shape: each rank's memory while FSDP2 exports it (CPU, gloo)\n",
            f"The hf-load table's model ({fmt(model_mib, ',.0f')} MiB in fp32: the model), stored "
            f"in {args.hf_load_dtypes[0]} as safetensors, `{' '.join(HF_EXPORT_RUN)}`: after one "
            "epoch the merged model is exported (fp32 files). Each rank's RssAnon from the line "
            f"{HF_EXPORT_FROM!r} until {HF_EXPORT_UNTIL!r}, less what it held at the first; "
            + ("one run" if args.hf_load_repeats == 1
               else f"median of {args.hf_load_repeats} runs") + " per configuration.\n",
            markdown_table(headers, rows)]

if "hf-load" in args.only:
    model_mib = 4 * hf_parameters / MIB if hf_parameters else None  # fp32, as the script trains
    headers = ["world size", "stored in", "way", "peak RssAnon above the tiny T5's, per rank "
               "(MiB)", "per rank, in models", "max over ranks (MiB)", "max, in models",
               f"target: model / N + {HF_LOAD_TARGET:.0%} of it (MiB)", "target, in models",
               "within target"]
    rows, tiny_said, within = [], [], {}  # (dtype, way) -> [(within, max in models)]
    for c in (c for c in configs if c["benchmark"] == "hf-load"):
        ranks = [f"rank{rank}_mib" for rank in range(c["world_size"])]
        tiny = find("hf-load", "cpu", world_size=c["world_size"], dtype="tiny")
        if c is tiny:
            tiny_said.append(f"{c['world_size']} ranks "
                             + " / ".join(fmt(median(c, key), ".0f") for key in ranks)
                             + (" (FAILED)" if c["failed"] else ""))
            continue
        above = [None if median(c, key) is None or median(tiny, key) is None
                 else median(c, key) - median(tiny, key) for key in ranks]
        most = None if None in above else max(above)
        target = model_mib * (1 / c["world_size"] + HF_LOAD_TARGET) if model_mib else None
        if most is not None and target:
            within.setdefault((c["dtype"], c["way"]), []).append((most <= target,
                                                                  most / model_mib))
        rows.append([c["world_size"], c["dtype"] + (" (FAILED)" if c["failed"] else ""),
                     c["way"] + f" ({HF_LOAD_WAYS[c['way']]})",
                     " / ".join(fmt(a, ".0f") for a in above),
                     " / ".join(fmt(ratio(a, model_mib), ".2f") for a in above),
                     fmt(most, ".0f"), fmt(ratio(most, model_mib), ".2f"), fmt(target, ".0f"),
                     fmt(ratio(target, model_mib), ".2f"),
                     "n/a" if most is None or not target else "yes" if most <= target else "no"])
    hf_runs_said = ("one run" if args.hf_load_repeats == 1
                    else f"median of {args.hf_load_repeats} runs") + " per configuration"
    summary = []
    for (dtype, way), results in within.items():
        grew = sorted({f"{fraction:.2f}" for _, fraction in results}, key=float)
        summary.append(f"stored in {dtype}, {way}, the rank that grew most grew by "
                       f"{'-'.join(grew[::len(grew) - 1] if len(grew) > 1 else grew)} of the "
                       f"model, within the target at {sum(ok for ok, _ in results)} of "
                       f"{len(results)} world sizes")
    out += ["\n### T5 at t5-base's shape: each rank's memory while --cpu-ram-efficient-loading "
            "loads it (CPU, gloo)\n",
            f"Model: t5-base's shape with random weights ({fmt(hf_parameters, ',')} parameters, "
            f"{fmt(model_mib, ',.0f')} MiB in fp32: the model, below; written by "
            "tests/tiny_wikihow.py's write_tiny_t5), stored in "
            f"{' and '.join(args.hf_load_dtypes)} by benchmarks/hf_memory.py, once as safetensors "
            "(the new way: each rank reads its shards with DCP's HuggingFaceStorageReader) and "
            "once as a pytorch_model.bin (today's way, the fallback: rank 0 loads the whole model "
            "and broadcasts each rank's shards). "
            f"`{' '.join(HF_LOAD_RUN)}`, data the WikiHow-format fixture CSV of the tests; "
            f"{hf_runs_said}. Each rank's RssAnon (anonymous memory: not the page cache of "
            "memory-mapped files) is sampled every 10 ms from the start until the script prints "
            f"'{HF_LOAD_UNTIL}' (loaded and sharded); the table gives its peak less the same "
            "rank's with the tests' tiny T5 (write_tiny_t5's defaults, same flags: "
            f"{'; '.join(tiny_said)} MiB), and as a fraction of the model (fp32, as the script "
            "trains). The target is the issue's: at most (model / world size) + "
            f"{HF_LOAD_TARGET:.0%} of the model on every rank.\n",
            markdown_table(headers, rows),
            "\n" + ("What it shows: " + "; ".join(summary) + "." if summary else
                    "What it shows: nothing, no configuration was measured against its baseline.")]

if "cpu-memory" in args.only:
    headers = ["run (world size 2, CPU)", "peak RssAnon / rank, kept (MiB)", "returned (MiB)",
               "returned / kept", "T5: rise after loading, kept (MiB)", "returned (MiB)",
               "returned / kept", "same train loss", "wall s, kept", "returned"]
    rows = []
    for row in dict.fromkeys(c["row"] for c in configs if c["benchmark"] == "cpu-memory"):
        kept, returned = (find("cpu-memory", "cpu", row=row, way=way) for way in CPU_MEMORY_WAYS)
        same = (median(kept, "train_loss") == median(returned, "train_loss")
                if median(kept, "train_loss") is not None else None)
        rows.append([row + (" (FAILED)" if kept["failed"] or returned["failed"] else ""),
                     fmt(median(kept, "rss_anon_mib"), ",.0f"),
                     fmt(median(returned, "rss_anon_mib"), ",.0f"),
                     fmt(ratio(median(returned, "rss_anon_mib"), median(kept, "rss_anon_mib")),
                         ".2f"),
                     fmt(median(kept, "above_loaded_mib"), ",.0f"),
                     fmt(median(returned, "above_loaded_mib"), ",.0f"),
                     fmt(ratio(median(returned, "above_loaded_mib"),
                               median(kept, "above_loaded_mib")), ".2f"),
                     "n/a" if same is None else "yes" if same else "no",
                     fmt(median(kept, "wall_s"), ".1f"), fmt(median(returned, "wall_s"), ".1f")])
    out += ["\n### Memory returned on CPU: glibc's default against --return-freed-memory "
            "(CPU, gloo)\n",
            f"{lora_source}; the other rows: {mnist_source or 'MNIST'}, FSDP2's defaults, "
            f"{t5_source or 'the tiny T5'} with `{' '.join(T5_SIZES)}`. LoRA rows: "
            f"`{' '.join([*LORA_SIZES, *LORA_RUN, *LORA])}`. Kept: the scripts' default, glibc's "
            "(it raises its mmap threshold to the largest block freed, up to 32 MiB, and keeps "
            "what is freed below it); returned: --return-freed-memory (256 KiB, fixed). Each "
            "rank's RssAnon (anonymous memory) is sampled every 10 ms: its peak over the whole "
            "run, for T5 from the line "
            f"'{CPU_MEMORY_LOADED}' on, and for T5 the rise of that peak above the first "
            f"sample after that line (the level after loading); the maximum over ranks; "
            f"{runs_said}, the two ways taking turns. Wall s: the training's, from the "
            "metrics file.\n",
            markdown_table(headers, rows)]

if "lengths" in args.only:
    rows = []
    for data in LENGTHS_T5_DATA:
        padded, batched = (find("lengths", "cpu", row=f"T5, {data}", way=way)
                           for way in LENGTHS_T5_WAYS)
        rows.append([f"T5, {data}", "samples/s", fmt(median(padded, "samples_per_s"), ".3f"),
                     fmt(median(batched, "samples_per_s"), ".3f"),
                     fmt(ratio(median(batched, "samples_per_s"), median(padded, "samples_per_s")),
                         ".2f")])
    padded, packed = (find("lengths", "cpu", row="fsdp2", way=way) for way in LENGTHS_FSDP2_WAYS)
    rows.append(["fsdp2_transformer.py, log-normal documents", "useful tokens/s",
                 fmt(median(padded, "useful_tokens_per_s"), ",.0f"),
                 fmt(median(packed, "useful_tokens_per_s"), ",.0f"),
                 fmt(ratio(median(packed, "useful_tokens_per_s"),
                           median(padded, "useful_tokens_per_s")), ".2f")])
    out += ["\n### Variable lengths: padded against token batches and packed documents "
            "(world size 2, CPU, gloo)\n",
            f"T5: {lora_source.split(', WikiHow')[0].split(', data')[0]}; `{' '.join(LENGTHS_T5)}`"
            "; data the tests' WikiHow-format fixture (articles of 1-3 sentences) and "
            "benchmarks/wikihow_lengths.py's (log-normal lengths with WikiHow's published means: "
            "articles of about 780 tokens, summaries of 78, 57% of articles longer than 512); "
            f"padded: the tutorial's padding to 512 + 150; token batches: "
            f"`{' '.join(LENGTHS_T5_WAYS['--max-tokens 1324'])}` (the padded batch's tokens). "
            f"fsdp2: `{' '.join(LENGTHS_FSDP2)}`, documents one per row (`--pad-documents`) or "
            f"packed; useful tokens: those in documents. {runs_said}, the ways taking turns.\n",
            markdown_table(["run", "figure", "padded", "token batches / packed", "ratio"], rows)]

if "fault-tolerance" in args.only:
    rows = []
    for way in FT_WAYS:
        c = find("fault-tolerance", "cpu", way=way)
        rows.append([way + (" (FAILED)" if c["failed"] else ""), fmt(median(c, "step_ms"), ".0f"),
                     fmt(median(c, "pause_s"), ".2f"), fmt(median(c, "new_step_s"), ".2f"),
                     fmt(median(c, "rejoined_s"), ".1f"), fmt(median(c, "steps_again"), ".0f"),
                     fmt(median(c, "steps_alone"), ".0f"), fmt(median(c, "final_loss"), ".3f")])
    out += ["\n### A rank killed: torchft's replica groups against a full restart "
            "(4 processes, CPU, gloo)\n",
            f"fsdp2_transformer.py's default model, `{' '.join(FT_RUN)}`; SIGKILL of the second "
            f"replica's second rank once a step line says step {FT_KILL_STEP}. By the times the "
            "step lines came (the survivors: torchft's group 0; in a full restart, every rank): "
            "the survivors' longest pause between two steps from the kill on; the seconds from "
            "the kill to the first step past those done before it (their lines may come up to "
            "0.3 s after it), and to the killed replica's first step once it is back (healed, or "
            "resumed). Steps again: steps trained a second time (from the last checkpoint); steps "
            "alone: those the survivors trained before the killed replica was back (its rows "
            f"skipped). Step time: the median before the kill. Final loss: group 0's, or the "
            f"job's; the {runs_said}, the ways taking turns.\n",
            markdown_table(["way", "step time (ms)", "survivors' longest pause (s)",
                            "kill -> first new step (s)", "kill -> killed replica back (s)",
                            "steps again", "steps alone", "final loss"], rows)]

elapsed = time.perf_counter() - started
out.append(f"\nTotal wall time: {elapsed / 60:.1f} min for {len(runs)} runs"
           f"{f', {len(failures)} FAILED' if failures else ''}.")
markdown = "\n".join(out) + "\n"
print(markdown)
if args.out:
    Path(args.out).write_text(markdown)
if args.raw_json:
    Path(args.raw_json).write_text(json.dumps({"machine": machine, "settings": vars(args),
                                               "runs": runs}, indent=2, default=str))
shutil.rmtree(tmp, ignore_errors=True)  # the fixtures and what the runs wrote
if failures:
    log(f"{len(failures)} run(s) FAILED (their stderr is shown above):")
    for run in failures:
        log(f"  {run['benchmark']} {run['device']} world size {run['world_size']} {run['name']}, "
            f"run {run['repeat']}: {run['error']}")
    sys.exit(1)
