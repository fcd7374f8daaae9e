"""Bad input, all four scripts, in two tables.

CHECKS: what a check decides, in the test's process, at milliseconds a row: each script's flag
checks (flag_problem, argparse's types), its inputs (data, model directory, checkpoint folders),
each a function that returns the line a run stops with. JOBS: a few rows per script run the real
script on 2 ranks (under torchrun; or with python), which prove that main applies those checks and
that what only a job shows (a read that fails on every rank, divergence, memory) ends the same way:
a non-zero exit within 60 s, exactly one `error:` line (from rank 0) that names the problem, no
traceback, and nothing written (the run's folder is the same before and after).
"""
import fcntl
import json
import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import huggingface_hub
import pytest
import torch
from conftest import (
    FSDP2_TINY,
    LORA,
    MNIST_TINY,
    REPO,
    SMOKE,
    copy_fsdp2_checkpoint,
    run_command,
    single_error_line,
    t5_args,
    torchrun_command,
)
from tiny_wikihow import write_csv_without_headline

sys.path.insert(0, str(REPO))
import ddp_mnist  # noqa: E402
import fsdp1_mnist  # noqa: E402
import fsdp2_transformer  # noqa: E402
import t5_fsdp_finetune  # noqa: E402
from safeguards import fsdp2_checks, mnist_checks, t5_checks  # noqa: E402
from safeguards.checkpoints import lock_problem, marker_problem, output_problem  # noqa: E402
from safeguards.fsdp2_saves import fsdp2_folder  # noqa: E402
from summarization_dataset import WikiHowError, read_articles  # noqa: E402

CPU = torch.device("cpu")
# A run that would succeed; each case appends what makes it fail (argparse: the last value wins).
BASE_ARGS = {
    "fsdp1_mnist.py": ["--data-dir", "{mnist}", "--epochs", 1, *MNIST_TINY, "--save-model"],
    "ddp_mnist.py": ["--data-dir", "{mnist}", "--epochs", 1, *MNIST_TINY, "--save-model"],
    "fsdp2_transformer.py": [*FSDP2_TINY, "--steps", 20],
    "t5_fsdp_finetune.py": [*t5_args("{t5_model}", "{wikihow}", 1), "--save-dir", "out"],
}
MODULES = {"fsdp1_mnist.py": fsdp1_mnist, "ddp_mnist.py": ddp_mnist,
           "fsdp2_transformer.py": fsdp2_transformer, "t5_fsdp_finetune.py": t5_fsdp_finetune}


def parsed(script, inputs, args):
    """The script's flags, parsed from its BASE_ARGS and args ({placeholders} made by inputs)."""
    return MODULES[script].parse_args([str(a).format_map(inputs)
                                       for a in [*BASE_ARGS[script], *args]])


def flags(script, *args, world_size=2):
    """The line the script's flag checks stop with (flag_problem), at world_size on CPU."""
    def check(inputs):
        values = parsed(script, inputs, args)
        if script == "fsdp2_transformer.py":
            return fsdp2_checks.flag_problem(values, CPU, world_size)
        if script == "t5_fsdp_finetune.py":
            return t5_checks.flag_problem(values, CPU, world_size, "trainer_state.json")
        return mnist_checks.flag_problem(values, CPU, world_size)
    return check


def refused(script, *args):
    """argparse's line for a value its types refuse: the script's parse_args exits 2."""
    def check(inputs, capsys):
        with pytest.raises(SystemExit) as stop:
            parsed(script, inputs, args)
        assert stop.value.code == 2
        return capsys.readouterr().err.strip().splitlines()[-1]
    return check


def mnist_data(name):
    """The line loading MNIST from the input `name` (missing: a folder that is not there) stops
    with (a ValueError)."""
    def check(inputs):
        folder = inputs["tmp"] / "missing" if name == "missing" else inputs[name]
        with pytest.raises(ValueError) as error:
            mnist_checks.loaded_mnist(str(folder), fsdp1_mnist.load_mnist)
        return str(error.value)
    return check


def wikihow_data(name):
    """The line reading the train split from the input `name` stops with (a WikiHowError)."""
    def check(inputs):
        with pytest.raises(WikiHowError) as error:
            read_articles(str(inputs[name]), "train")
        return str(error.value)
    return check


def lora_resume(*args):
    return flags("t5_fsdp_finetune.py", "--resume", *args)


CHECKS = [  # id, a function of the inputs (and capsys: argparse's) giving the line, what it says
    ("MNIST missing", mnist_data("missing"),
     ["missing/MNIST/raw", "downloading it failed", "--data-dir", "tests/digits_mnist.py"]),
    ("MNIST truncated IDX", mnist_data("truncated_idx"),
     ["cannot read MNIST", "truncated_idx/MNIST/raw", "train-images-idx3-ubyte has 1000 bytes",
      "truncated?"]),
    ("MNIST malformed IDX header", mnist_data("bad_idx_header"),
     ["cannot read MNIST", "bad_idx_header/MNIST/raw",
      "t10k-labels-idx1-ubyte does not start with an IDX header"]),
    ("MNIST fewer labels than images", mnist_data("fewer_labels"),
     ["cannot use MNIST", "1500 images but 1495 labels"]),
    ("MNIST label out of range", mnist_data("label_ten"),
     ["cannot use MNIST", "labels outside 0-9 (from 0 to 10)"]),
    ("MNIST CPU offload without GPU", flags("fsdp1_mnist.py", "--no-cuda", "--cpu-offload"),
     ["--cpu-offload", "GPU"]),
    ("MNIST batch size 0", refused("ddp_mnist.py", "--batch-size", 0),
     ["--batch-size", "positive integer, got 0"]),
    ("MNIST NaN learning rate", refused("ddp_mnist.py", "--lr", "nan"),
     ["--lr", "must be a positive number", "got nan"]),
    ("MNIST infinite timeout", refused("fsdp1_mnist.py", "--dist-timeout", "inf"),
     ["--dist-timeout", "got inf"]),
    ("MNIST growing gamma", refused("fsdp1_mnist.py", "--gamma", 2),
     ["--gamma", "from 0 to 1, got 2"]),
    ("MNIST unwritable metrics", lambda i: output_problem({}, {
        "--metrics-json": f"{i['a_file']}/metrics.json"}), ["--metrics-json", "a_file is a file"]),
    ("MNIST metrics path is a folder", lambda i: output_problem({}, {"--metrics-json": i["empty"]}),
     ["--metrics-json", "empty is a folder"]),
    ("FSDP2 CPU offload without GPU", flags("fsdp2_transformer.py", "--cpu-offload"),
     ["--cpu-offload", "needs a CUDA GPU"]),
    ("FSDP2 float8 without GPU", flags("fsdp2_transformer.py", "--mixed-precision", "--float8",
                                       "tensorwise"),
     ["--float8 tensorwise", "compute capability 8.9", "no GPU is in use"]),
    ("FSDP2 no steps", refused("fsdp2_transformer.py", "--steps", 0),
     ["--steps", "must be a positive integer, got 0"]),
    ("FSDP2 batch vs ranks", flags("fsdp2_transformer.py", "--batch-size", 6,
                                   "--grad-accum-steps", 2),
     ["--batch-size 6", "use a multiple of 4"]),
    ("FSDP2 no timeout", refused("fsdp2_transformer.py", "--dist-timeout", 0),
     ["--dist-timeout", "positive number, got 0"]),
    ("FSDP2 replicas vs ranks", flags("fsdp2_transformer.py", "--replicate-degree", 3),
     ["--replicate-degree 3 does not divide the world size 2"]),
    ("FSDP2 async full checkpoint", flags("fsdp2_transformer.py", "--async-checkpoint"),
     ["--async-checkpoint", "add --checkpoint-format sharded"]),
    ("FSDP2 DCP API without a checkpoint dir", flags("fsdp2_transformer.py", "--dcp-api"),
     ["--dcp-api says how to save checkpoints", "add --checkpoint-dir"]),
    ("FSDP2 checkpoint of another model size", lambda i: marker_problem(
        str(i["fsdp2_checkpoint"] / "step_000010"), "COMPLETE",
        {"vocab_size": 64, "dim": 64, "n_layers": 3, "n_heads": 4, "seq_len": 16}),
     ["another model", "--dim 32", "--dim 64"]),
    ("FSDP2 marker of another step", lambda i: marker_problem(
        str(i["fsdp2_marker_edited"] / "step_000010"), "COMPLETE", {}),
     ["step_000010: its COMPLETE marker says step 7", "--no-resume"]),
    ("FSDP2 unwritable checkpoint dir", lambda i: output_problem(
        {"--checkpoint-dir": str(i["a_file"])}, {}), ["--checkpoint-dir", "a_file is a file"]),
    ("FSDP2 checkpoint dir in use", lambda i: lock_problem("--checkpoint-dir", str(i["locked"])),
     ["--checkpoint-dir", "locked is in use by another job"]),
    ("FSDP2 no-resume over older checkpoints", lambda i: fsdp2_folder(
        i["fsdp2_checkpoint"], "COMPLETE").earlier_run_problem("drop --no-resume"),
     ["--no-resume", "step_000010", "add --overwrite"]),
    ("FSDP2 negative max-norm", refused("fsdp2_transformer.py", "--max-norm", -1),
     ["--max-norm", "of 0 or more, got -1"]),
    ("FSDP2 seed too large", refused("fsdp2_transformer.py", "--seed", 2**64),
     ["--seed", "from 0 to 4,294,967,295"]),
    ("FSDP2 learning rate beyond float32", refused("fsdp2_transformer.py", "--lr", "1e42"),
     ["--lr", "at most 1e+30, got 1e42"]),
    ("FSDP2 plan for a device of 0 GiB", refused("fsdp2_transformer.py", "--plan",
                                                 "--plan-device-memory", 0),
     ["--plan-device-memory", "positive number, got 0"]),
    ("T5 missing CSV", flags("t5_fsdp_finetune.py", "--data-dir", "{empty}"),
     ["empty/wikihowAll.csv not found", "download", "ucsb.box.com"]),
    ("T5 missing columns", flags("t5_fsdp_finetune.py", "--data-dir", "{no_headline}"),
     ["no_headline/wikihowAll.csv", "lacks the column(s) headline"]),
    ("T5 truncated CSV", wikihow_data("truncated_csv"),
     ["cannot parse", "truncated_csv/wikihowAll.csv as CSV", "EOF inside string",
      "download it again"]),
    ("T5 header-only CSV", flags("t5_fsdp_finetune.py", "--data-dir", "{header_only_csv}"),
     ["header_only_csv/wikihowAll.csv has its header but no article"]),
    ("T5 missing model", flags("t5_fsdp_finetune.py", "--model-name", "{tmp}/no_model"),
     ["--model-name", "no_model: no such directory"]),
    ("T5 FSDP2 shard-by-shard loading of a missing model", flags(
        "t5_fsdp_finetune.py", "--model-name", "{tmp}/no_model", "--fsdp-version", 2,
        "--cpu-ram-efficient-loading"), ["--model-name", "no_model: no such directory"]),
    ("T5 directory without a model", flags("t5_fsdp_finetune.py", "--model-name", "{empty}"),
     ["cannot load a T5 model and tokenizer from the directory", "empty"]),
    ("T5 BERT config", flags("t5_fsdp_finetune.py", "--model-name", "{bert_model}"),
     ["holds a bert model, not T5"]),
    ("T5 hub model offline", flags("t5_fsdp_finetune.py", "--model-name", "fsdp-tests/no-such-t5"),
     ["--model-name fsdp-tests/no-such-t5 is not a local directory", "HF_HUB_OFFLINE"]),
    ("T5 missing data and model", flags("t5_fsdp_finetune.py", "--data-dir", "{empty}",
                                        "--model-name", "{tmp}/no_model"),
     ["empty/wikihowAll.csv not found", "--model-name", "no_model: no such directory"]),
    ("T5 unwritable save dir", lambda i: output_problem({"--save-dir": f"{i['a_file']}/out"}, {}),
     ["--save-dir", "a_file/out", "Not a directory"]),
    ("T5 resume auto without sharded checkpoints", flags("t5_fsdp_finetune.py", "--resume",
                                                         "auto"),
     ["--resume auto", "--checkpoint-type sharded"]),
    ("T5 FSDP1 without the full state dict", flags("t5_fsdp_finetune.py", "--no-full-state-dict"),
     ["--no-full-state-dict", "FSDP1 writes its HF files from the full state dict",
      "--fsdp-version 2"]),
    ("T5 max tokens below one example", flags("t5_fsdp_finetune.py", "--max-tokens", 87),
     ["--max-tokens 87", "--input-length + --output-length (88)", "at least 88"]),
    ("T5 trainer state of another epoch", flags("t5_fsdp_finetune.py", "--resume",
                                                "{t5_state_edited}"),
     ["trainer_state.json says epoch -1, not its folder's"]),
    ("T5 negative gamma", refused("t5_fsdp_finetune.py", "--gamma", -1),
     ["--gamma", "from 0 to 1"]),
    ("T5 huge output length", refused("t5_fsdp_finetune.py", "--output-length", 100000),
     ["--output-length", "at most 16,384"]),
    ("T5 generation length 0", refused("t5_fsdp_finetune.py", "--rouge",
                                       "--generation-max-length", 0),
     ["--generation-max-length", "must be a positive integer of at most 16,384, got 0"]),
    *[(f"T5 FSDP2 {' '.join(map(str, options))}", flags("t5_fsdp_finetune.py", "--fsdp-version",
                                                        2, *options),
       ["--fsdp-version 2 has no", *says])
      for options, says in [
          (["--sharding-strategy", "NO_SHARD"], ["FULL_SHARD or SHARD_GRAD_OP", "ddp_mnist.py"]),
          (["--backward-prefetch", "BACKWARD_POST"], ["as BACKWARD_PRE does", "leave the flag"]),
          (["--backward-prefetch", "NONE"], ["always prefetches", "leave the flag out"]),
          (["--limit-all-gathers"], ["bounds its all-gathers itself", "leave the flag out"]),
          (["--no-limit-all-gathers"], ["bounds its all-gathers itself", "leave the flag out"]),
          (["--mixed-precision", "fp16"], ["use bf16, or fp32"])]],
    ("T5 LoRA targets that name no module", flags("t5_fsdp_finetune.py", "--lora-rank", 8,
                                                  "--lora-targets", "q,query,v"),
     ["--lora-targets q,query,v: the model has no Linear module named query",
      "its Linear modules are named q, k, v, o, wi, wo, lm_head"]),
    ("T5 base dtype without LoRA", flags("t5_fsdp_finetune.py", "--base-dtype", "bf16"),
     ["--base-dtype bf16 stores the frozen base of LoRA", "add --lora-rank"]),
    ("T5 LoRA resume with another rank", lora_resume("{lora_checkpoint}", "--epochs", 2, *LORA,
                                                     "--lora-rank", 4),
     ["checkpoint-epoch-1: it was saved by --lora-rank 8 --lora-alpha 16 --lora-dropout 0.0 "
      "--lora-targets q,v --base-dtype fp32, not --lora-rank 4",
      "pass the flags it was saved with"]),
    ("T5 full fine-tuning checkpoint resumed with LoRA", lora_resume("{t5_checkpoint}",
                                                                     "--epochs", 2, *LORA),
     ["it was saved by full fine-tuning, not --lora-rank 8"]),
    ("T5 ROUGE without validation", flags("t5_fsdp_finetune.py", "--rouge",
                                          "--no-run-validation"),
     ["--rouge scores summaries of the validation articles", "--no-run-validation"]),
    ("T5 ROUGE without rouge_score", flags("t5_fsdp_finetune.py", "--rouge"),
     ["--rouge needs the rouge_score package, which is not installed",
      "pip install rouge_score=="]),
    ("T5 generation options without ROUGE", flags("t5_fsdp_finetune.py", "--num-beams", 4,
                                                  "--best-metric", "rougeL"),
     ["--num-beams, --best-metric: for the summaries that --rouge generates; add --rouge"]),
    ("T5 compile under FSDP1", flags("t5_fsdp_finetune.py", "--compile"),
     ["--compile: torch.compile cannot trace FSDP1's units", "use --fsdp-version 2"]),
    ("T5 compile with max tokens", flags("t5_fsdp_finetune.py", "--compile", "--fsdp-version", 2,
                                         "--max-tokens", 200),
     ["--compile compiles each block for one shape", "--max-tokens cuts micro-batches of other "
      "lengths, each compiled anew: drop one"]),
]
# What a check row sees besides its flags: rouge_score not importable, the hub offline.
MISSING_MODULES = {"T5 ROUGE without rouge_score": "rouge_score"}
OFFLINE = {"T5 hub model offline", "T5 missing model", "T5 missing data and model",
           "T5 FSDP2 shard-by-shard loading of a missing model"}

JOBS = [  # id, script, launcher, args, what the error line must say
    # main applies the flag checks
    ("FSDP2 dim vs heads", "fsdp2_transformer.py", "torchrun", ["--dim", 30, "--n-heads", 4],
     ["--dim 30 is not divisible by --n-heads 4"]),
    ("MNIST CPU offload without GPU", "fsdp1_mnist.py", "torchrun",
     ["--no-cuda", "--cpu-offload"], ["--cpu-offload", "GPU"]),
    # ... and a python launch applies them before it starts any process
    ("T5 missing CSV", "t5_fsdp_finetune.py", "python", ["--data-dir", "{empty}"],
     ["empty/wikihowAll.csv not found", "download", "ucsb.box.com"]),
    ("MNIST batch size 0", "ddp_mnist.py", "python", ["--batch-size", 0],
     ["--batch-size", "positive integer, got 0"]),
    # main applies the checks of outputs, data, model and folders
    ("MNIST model file is a folder", "ddp_mnist.py", "torchrun",
     ["--data-dir", "{mnist_beside_a_folder}"], ["--save-model", "mnist_cnn.pt is a folder"]),
    ("MNIST missing", "fsdp1_mnist.py", "torchrun", ["--data-dir", "{tmp}/missing"],
     ["missing/MNIST/raw", "downloading it failed", "--data-dir", "tests/digits_mnist.py"]),
    ("FSDP2 checkpoint dir in use", "fsdp2_transformer.py", "torchrun",
     ["--checkpoint-dir", "{locked}"], ["--checkpoint-dir", "locked is in use by another job"]),
    ("FSDP2 checkpoint of another model size", "fsdp2_transformer.py", "torchrun",
     ["--checkpoint-dir", "{fsdp2_checkpoint}", "--dim", 64],
     ["another model", "--dim 32", "--dim 64"]),
    ("T5 tokenizer files missing", "t5_fsdp_finetune.py", "torchrun",
     ["--model-name", "{t5_without_tokenizer}"],
     ["its tokenizer has", "tokenizer files are missing"]),
    ("T5 ROUGE into a save dir that is a file", "t5_fsdp_finetune.py", "torchrun",
     ["--rouge", "--no-save-model", "--save-dir", "{a_file}/out"],
     ["--save-dir", "a_file/out", "Not a directory"]),
    # what only a job shows: a read that fails on every rank, divergence, memory
    ("FSDP2 corrupted checkpoint", "fsdp2_transformer.py", "torchrun",
     ["--checkpoint-dir", "{fsdp2_truncated}", "--dcp-api"],
     ["cannot read checkpoint", "step_000010", "--no-resume"]),
    ("FSDP2 corrupted sharded checkpoint", "fsdp2_transformer.py", "torchrun",
     ["--checkpoint-dir", "{fsdp2_sharded_truncated}", "--dim", 128],
     ["cannot read checkpoint", "fsdp2_sharded_truncated/step_000010", "--no-resume"]),
    ("FSDP2 out of memory", "fsdp2_transformer.py", "torchrun", ["--vocab-size", 2_000_000_000],
     ["out of memory", "can't allocate memory", "--batch-size", "--vocab-size"]),
    ("MNIST diverging", "fsdp1_mnist.py", "torchrun", ["--lr", "1e30"],
     ["training diverged", "a gradient of optimizer step", "not finite", "--lr"]),
    ("T5 diverging", "t5_fsdp_finetune.py", "torchrun", ["--lr", "1e30", "--no-save-model"],
     ["training diverged", "a gradient of optimizer step", "not finite", "--lr"]),
    ("T5 corrupted checkpoint", "t5_fsdp_finetune.py", "torchrun",
     ["--resume", "{t5_corrupt}", "--epochs", 2],
     ["--resume", "t5_corrupt: cannot load it", "corrupted"]),
    ("T5 LoRA resume onto another base", "t5_fsdp_finetune.py", "torchrun",
     ["--resume", "{lora_checkpoint}", "--epochs", 2, *LORA, "--model-name", "{untied_model}"],
     ["checkpoint-epoch-1: its adapters were trained on another base model than --model-name",
      "pass the --model-name it was trained with"]),
]


def make_dir(path):
    path.mkdir()
    return path


def make_file(path):
    path.write_text("a file, where a directory is expected\n")
    return path


def copy_mnist(mnist_dir, dest, edit_name, edit):
    raw = dest / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for f in (mnist_dir / "MNIST" / "raw").iterdir():
        (raw / f.name).write_bytes(edit(f.read_bytes()) if f.name == edit_name else f.read_bytes())
    return dest


def copy_wikihow(wikihow_dir, dest, edit):
    shutil.copytree(wikihow_dir, dest)
    csv = dest / "wikihowAll.csv"
    csv.write_bytes(edit(csv.read_bytes()))
    return dest


def cut_inside_a_quoted_field(csv_bytes):
    """The file as a download cut short leaves it: ending half way through a quoted field."""
    opening_quote = csv_bytes.index(b',"', len(csv_bytes) // 2) + 1
    return csv_bytes[:opening_quote + 5]


def truncate_a_shard(checkpoint, dest):
    """A copy of a DCP checkpoint folder, at dest, whose first shard file is cut short."""
    checkpoint = shutil.copytree(checkpoint, dest)
    shard = sorted(checkpoint.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:1000])
    return checkpoint


def truncated_optimizer_file(fsdp2_reference, dest):
    folder = copy_fsdp2_checkpoint(fsdp2_reference, 10, dest)
    optimizer_file = folder / "step_000010" / "optimizer.pt"
    optimizer_file.write_bytes(optimizer_file.read_bytes()[:1000])
    return folder


def edited_json(folder, name, **values):
    """Change values of the JSON file folder/name; return folder."""
    data = json.loads((folder / name).read_text())
    (folder / name).write_text(json.dumps({**data, **values}))
    return folder


HELD_LOCKS = []


def locked_by_this_process(folder):
    """A --checkpoint-dir that another job holds: this test process takes its lock."""
    folder.mkdir()
    descriptor = os.open(folder, os.O_RDONLY)
    fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
    HELD_LOCKS.append(descriptor)  # held until the session ends
    return folder


def fewer_labels(data):
    """An IDX label file whose header and contents say 5 labels fewer."""
    count = int.from_bytes(data[4:8], "big")
    return data[:4] + (count - 5).to_bytes(4, "big") + data[8:-5]


def failing_package(folder, name):
    """folder, holding a package `name` whose import fails as a missing one's does."""
    (folder / name).mkdir(parents=True)
    (folder / name / "__init__.py").write_text(f"raise ImportError('No module named {name}')\n")
    return folder


def copy_without(source, dest, names):
    """A copy of source without the files named."""
    return shutil.copytree(source, dest, ignore=lambda folder, found: set(found) & names)


# How each {placeholder} is made in the test's folder, from the fixtures it names (loaded only
# when used).
INPUTS = {
    "tmp": lambda tmp, f: tmp,
    "empty": lambda tmp, f: make_dir(tmp / "empty"),
    "a_file": lambda tmp, f: make_file(tmp / "a_file"),
    "mnist": lambda tmp, f: f("mnist_dir"),
    "truncated_idx": lambda tmp, f: copy_mnist(f("mnist_dir"), tmp / "truncated_idx",
                                               "train-images-idx3-ubyte",
                                               lambda data: data[:1000]),
    "bad_idx_header": lambda tmp, f: copy_mnist(f("mnist_dir"), tmp / "bad_idx_header",
                                                "t10k-labels-idx1-ubyte",
                                                lambda data: b"\x00\x00\x00\x00" + data[4:]),
    "fsdp2_truncated": lambda tmp, f: truncated_optimizer_file(f("fsdp2_reference"),
                                                               tmp / "fsdp2_truncated"),
    "fsdp2_sharded_truncated": lambda tmp, f: truncate_a_shard(
        f("fsdp2_sharded_reference").cwd / "ckpt" / "step_000010",
        tmp / "fsdp2_sharded_truncated" / "step_000010").parent,
    "fsdp2_checkpoint": lambda tmp, f: copy_fsdp2_checkpoint(f("fsdp2_reference"), 10,
                                                             tmp / "fsdp2_checkpoint"),
    "t5_model": lambda tmp, f: f("tiny_t5_dir"),
    "wikihow": lambda tmp, f: f("wikihow_dir"),
    "no_headline": lambda tmp, f: write_csv_without_headline(tmp),
    "truncated_csv": lambda tmp, f: copy_wikihow(f("wikihow_dir"), tmp / "truncated_csv",
                                                 cut_inside_a_quoted_field),
    "t5_corrupt": lambda tmp, f: truncate_a_shard(f("t5_reference").cwd / "checkpoint-epoch-1",
                                                  tmp / "t5_corrupt"),
    "fsdp2_marker_edited": lambda tmp, f: edited_json(
        copy_fsdp2_checkpoint(f("fsdp2_reference"), 10, tmp / "edited") / "step_000010",
        "COMPLETE", step=7).parent,
    "t5_checkpoint": lambda tmp, f: shutil.copytree(
        f("t5_reference").cwd / "checkpoint-epoch-1", tmp / "t5" / "checkpoint-epoch-1"),
    "lora_checkpoint": lambda tmp, f: shutil.copytree(
        f("lora_reference").cwd / "checkpoint-epoch-1", tmp / "lora" / "checkpoint-epoch-1"),
    "untied_model": lambda tmp, f: f("untied_t5_dir"),
    "t5_state_edited": lambda tmp, f: edited_json(
        shutil.copytree(f("t5_reference").cwd / "checkpoint-epoch-1", tmp / "checkpoint-epoch-1"),
        "trainer_state.json", epoch=-1),
    "locked": lambda tmp, f: locked_by_this_process(tmp / "locked"),
    "rouge_score_shadow": lambda tmp, f: failing_package(tmp / "shadow", "rouge_score"),
    "t5_without_tokenizer": lambda tmp, f: copy_without(
        f("tiny_t5_dir"), tmp / "no_tokenizer", {"tokenizer.json", "tokenizer_config.json",
                                                 "special_tokens_map.json", "spiece.model"}),
    "bert_model": lambda tmp, f: edited_json(shutil.copytree(f("tiny_t5_dir"), tmp / "bert"),
                                             "config.json", model_type="bert"),
    "header_only_csv": lambda tmp, f: copy_wikihow(f("wikihow_dir"), tmp / "header_only_csv",
                                                   lambda data: data[:data.index(b"\n") + 1]),
    "mnist_beside_a_folder": lambda tmp, f: (make_dir(tmp / "mnist_cnn.pt"), f("mnist_dir"))[1],
    "fewer_labels": lambda tmp, f: copy_mnist(f("mnist_dir"), tmp / "fewer_labels",
                                              "train-labels-idx1-ubyte", fewer_labels),
    "label_ten": lambda tmp, f: copy_mnist(f("mnist_dir"), tmp / "label_ten",
                                           "t10k-labels-idx1-ubyte",
                                           lambda data: data[:8] + bytes([10]) + data[9:]),
}


class Inputs(dict):
    """str.format_map mapping that makes each input the first time a case's arguments name it."""

    def __init__(self, tmp_path, fixture):
        super().__init__()
        self.tmp_path, self.fixture = tmp_path, fixture

    def __missing__(self, name):
        self[name] = INPUTS[name](self.tmp_path, self.fixture)
        return self[name]


def folder_state(folder):
    """Every path under folder, with size and modification time for files."""
    return {(str(p.relative_to(folder)), None) if p.is_dir()
            else (str(p.relative_to(folder)), p.stat().st_size, p.stat().st_mtime_ns)
            for p in folder.rglob("*")}


RUNS = {}  # case id: Future of (Run, seconds, folder before, folder after)


def start_early(request):
    """Start every selected job, in a folder of its own; called by conftest as the session starts.
    The runs go one at a time on a thread of their own, beside the other tests, and this file's
    tests run last, each waiting for its job. T5's runs, the longest, go first."""
    # Only the jobs this session runs (pytest -k, -m smoke): the table's inputs need fixtures.
    selected = {item.callspec.params["name"] for item in request.session.items
                if getattr(item, "originalname", None) == "test_a_bad_input_ends_the_job_cleanly"}
    pool = ThreadPoolExecutor(max_workers=1)
    for name, script, launcher, args, _ in sorted(JOBS, key=lambda job: "t5" not in job[1]):
        if name not in selected:
            continue
        folder = request.getfixturevalue("tmp_path_factory").mktemp("bad_input")
        inputs = Inputs(folder, request.getfixturevalue)  # made here: they load fixtures
        command = [str(a).format_map(inputs) for a in [*BASE_ARGS[script], *args]]
        launch = ([sys.executable, REPO / script, *command] if launcher == "python"
                  else torchrun_command(script, command, 2))
        RUNS[name] = pool.submit(run_job, launch, folder, folder_state(folder))
    pool.shutdown(wait=False)


def run_job(command, folder, before):
    start = time.perf_counter()
    result = run_command(command, folder, timeout=60)
    return result, time.perf_counter() - start, before, folder_state(folder)


# The smoke tier's rows: one per script.
SMOKE_CASES = {"FSDP2 dim vs heads": "fsdp2_transformer.py",
               "MNIST CPU offload without GPU": "fsdp1_mnist.py",
               "MNIST batch size 0": "ddp_mnist.py", "T5 missing CSV": "t5_fsdp_finetune.py"}


@pytest.mark.parametrize("name, expected", [
    pytest.param(name, expected, marks=[SMOKE(SMOKE_CASES[name])] if name in SMOKE_CASES else [])
    for name, _, _, _, expected in JOBS], ids=[job[0] for job in JOBS])
def test_a_bad_input_ends_the_job_cleanly(name, expected):
    result, seconds, before, after = RUNS[name].result()
    assert result.returncode != 0 and seconds < 60
    error_line = single_error_line(result)
    assert all(e in error_line for e in expected), error_line
    assert after == before, "the failed run wrote files"


@pytest.mark.parametrize("name, check, expected", CHECKS, ids=[case[0] for case in CHECKS])
def test_a_check_gives_the_line_that_names_the_fix(name, check, expected, tmp_path, request,
                                                   monkeypatch, capsys):
    """The line each check returns (argparse's: prints) for a bad input, and nothing written: a
    second call, once the first made the row's inputs, leaves the folder as it was."""
    inputs = Inputs(tmp_path, request.getfixturevalue)
    if name in MISSING_MODULES:
        monkeypatch.setitem(sys.modules, MISSING_MODULES[name], None)  # its import fails
    if name in OFFLINE:
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)
    lines = []
    for _ in range(2):
        before = folder_state(tmp_path)
        lines.append(check(inputs, capsys) if check.__code__.co_argcount == 2 else check(inputs))
    assert lines[0] == lines[1] and folder_state(tmp_path) == before
    assert lines[1] and "\n" not in lines[1] and all(e in lines[1] for e in expected), lines[1]

