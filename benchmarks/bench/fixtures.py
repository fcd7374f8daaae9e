"""The data and models benchmarks share, written once into the runner's temporary folder.

The fixtures come from the tests' own generators, run through their command lines. A benchmark
names those it reads in FIXTURES; write() writes each asked-for fixture once, in this order
(a later one reuses what an earlier one wrote), and puts its paths and its caption on ctx:

    mnist  ctx.mnist_dir, ctx.mnist_source       (the tests' digits, unless --mnist-dir)
    t5     ctx.wikihow_dir, ctx.t5_model, ctx.t5_source
                                                 (the tests' WikiHow CSV and tiny T5, unless
                                                 --wikihow-dir and --t5-model)
    lora   ctx.lora_model, ctx.lora_data, ctx.lora_source
                                                 (a t5-base-shaped random T5, 0.79 GB, unless
                                                 --lora-model; the WikiHow CSV)
    hf     ctx.hf_data, ctx.hf_tiny, ctx.hf_models[(dtype, "safetensors" or "bin")],
           ctx.hf_parameters                     (the t5-base-shaped T5 stored in each of
                                                 --hf-load-dtypes by benchmarks/hf_memory.py)

With --dry-run nothing is written (the commands name the folders it would write).
Not a benchmark (it has no NAME): bench.load() passes it over.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

from .common import REPO, log

# lora: t5-base's shape (d_model 768, 12 + 12 layers, 12 heads of 64, d_ff 3072, 32 relative
# attention buckets) with random weights and the tests' tokenizer (232 ids): 198,407,424
# parameters, 0.79 GB in fp32, made offline by tests/tiny_wikihow.py's write_tiny_t5.
T5_BASE_SHAPE = {"d_model": 768, "num_layers": 12, "num_heads": 12, "d_kv": 64, "d_ff": 3072,
                 "relative_attention_num_buckets": 32, "relative_attention_max_distance": 128}
HF_LOAD_DTYPES = ("bf16", "fp32")
HF_FORMATS = ("safetensors", "bin")  # the order benchmarks/hf_memory.py takes their folders in


def add_flags(parser):
    """The flags that replace a fixture with the user's own data or model, and --hf-load-dtypes
    (the hf fixture's)."""
    add = parser.add_argument
    add("--mnist-dir", default=None, metavar="DIR",
        help="folder holding MNIST/raw (unset: the tests' digits fixture, in a temporary folder)")
    add("--wikihow-dir", default=None, metavar="DIR",
        help="folder with wikihowAll.csv (unset: the tests' WikiHow fixture, in a temporary "
             "folder)")
    add("--t5-model", default=None, metavar="DIR_OR_ID",
        help="T5 model directory or hub id (unset: the tests' tiny T5 fixture, in a temporary "
             "folder)")
    add("--lora-model", default=None, metavar="DIR",
        help="lora: a T5 directory instead of the t5-base-shaped random model (unset: written "
             "into the temporary folder, 0.79 GB)")
    add("--hf-load-dtypes", nargs="+", choices=HF_LOAD_DTYPES, default=list(HF_LOAD_DTYPES),
        metavar="DTYPE", help="hf-load: the dtypes the t5-base-shaped model is stored in, any "
        f"of {', '.join(HF_LOAD_DTYPES)}")


def write_fixture(ctx, what, command):
    """Run one of the tests' fixture generators; if it fails, say so and how to do without it.
    --dry-run: nothing."""
    if ctx.args.dry_run:
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


def write(ctx, needed):
    """Write the fixtures named in needed (and set every fixture's paths and captions on ctx)."""
    args = ctx.args
    # Each run starts in a folder of its own: local paths must be absolute to mean the same there.
    ctx.mnist_dir, ctx.wikihow_dir, ctx.t5_model = (
        os.path.abspath(p) if p and os.path.exists(p) else p
        for p in (args.mnist_dir, args.wikihow_dir, args.t5_model))
    ctx.mnist_source = f"Data: MNIST from {ctx.mnist_dir}" if ctx.mnist_dir else None
    ctx.t5_source = (f"Model {ctx.t5_model}, WikiHow from {ctx.wikihow_dir}"
                     if ctx.t5_model and ctx.wikihow_dir else None)
    if "mnist" in needed and not ctx.mnist_dir:
        write_mnist(ctx)
    if "t5" in needed and not (ctx.wikihow_dir and ctx.t5_model):
        write_t5(ctx)
    if "lora" in needed:
        write_lora(ctx)
    if "hf" in needed:
        write_hf(ctx)


def write_mnist(ctx):
    ctx.mnist_dir = ctx.tmp / "mnist"
    log(f"Writing the MNIST digits fixture (tests/digits_mnist.py) to {ctx.mnist_dir}")
    write_fixture(ctx, "MNIST digits", [REPO / "tests" / "digits_mnist.py", ctx.mnist_dir])
    images = "?" if ctx.args.dry_run else mnist_train_samples(ctx.mnist_dir)
    ctx.mnist_source = ("Data: the offline digits fixture of the tests, not MNIST "
                        "(tests/digits_mnist.py: scikit-learn's digits as 28x28 MNIST files, "
                        f"{images} training images)")


def write_t5(ctx):
    fixture_data, fixture_model = ctx.tmp / "wikihow", ctx.tmp / "tiny-t5"
    log(f"Writing the WikiHow and tiny T5 fixtures (tests/tiny_wikihow.py) to {ctx.tmp}")
    write_fixture(ctx, "WikiHow and tiny T5",
                  [REPO / "tests" / "tiny_wikihow.py", fixture_data, fixture_model])
    ctx.wikihow_dir = ctx.wikihow_dir or fixture_data
    ctx.t5_model = ctx.t5_model or fixture_model
    ctx.t5_source = ("Model "
                     + ("the tiny T5 fixture of the tests" if ctx.t5_model == fixture_model
                        else str(ctx.t5_model))
                     + ", data "
                     + ("the WikiHow-format fixture CSV of the tests"
                        if ctx.wikihow_dir == fixture_data else f"WikiHow from {ctx.wikihow_dir}")
                     + " (tests/tiny_wikihow.py)")
    # The datasets library caches each CSV it reads; keep the fixture's cache out of the user's.
    ctx.env["HF_DATASETS_CACHE"] = str(ctx.tmp / "hf_datasets_cache")


def write_t5_base_shape(ctx, folder):
    log(f"Writing a t5-base-shaped random T5 (198M parameters, 0.79 GB; tests/tiny_wikihow.py) "
        f"to {folder}")
    write_fixture(ctx, "t5-base-shaped T5", [
        "-c", "import json, sys; sys.path.insert(0, sys.argv[1]); import tiny_wikihow; "
        "tiny_wikihow.write_tiny_t5(sys.argv[2], **json.loads(sys.argv[3]))",
        REPO / "tests", folder, json.dumps(T5_BASE_SHAPE)])


def write_lora(ctx):
    args = ctx.args
    ctx.lora_model = args.lora_model  # a local folder made absolute: each run has its own folder
    if ctx.lora_model and os.path.exists(ctx.lora_model):
        ctx.lora_model = os.path.abspath(ctx.lora_model)
    ctx.lora_data = ctx.wikihow_dir
    if not ctx.lora_data:  # the t5 fixture's when it was written, else the CSV alone
        ctx.lora_data = ctx.tmp / "wikihow"
        log(f"Writing the WikiHow fixture (tests/tiny_wikihow.py) to {ctx.lora_data}")
        write_fixture(ctx, "WikiHow", [
            "-c", "import sys; sys.path.insert(0, sys.argv[1]); import tiny_wikihow; "
            "tiny_wikihow.write_wikihow(sys.argv[2])", REPO / "tests", ctx.lora_data])
        ctx.env["HF_DATASETS_CACHE"] = str(ctx.tmp / "hf_datasets_cache")
    if not ctx.lora_model:
        ctx.lora_model = ctx.tmp / "t5-base-shape"
        if not args.dry_run:
            write_t5_base_shape(ctx, ctx.lora_model)
    ctx.lora_source = (f"Model {ctx.lora_model}" if args.lora_model else
                       "Model: t5-base's shape with random weights and the tests' 232-token "
                       "vocabulary (tests/tiny_wikihow.py's write_tiny_t5, "
                       + ", ".join(f"{k} {v}" for k, v in T5_BASE_SHAPE.items()) + ")")
    ctx.lora_source += (f", WikiHow from {ctx.lora_data}" if args.wikihow_dir
                        else ", data the WikiHow-format fixture CSV of the tests")


def write_hf(ctx):
    tmp = ctx.tmp
    ctx.hf_data = Path(ctx.wikihow_dir or tmp / "wikihow")  # --wikihow-dir's is a str
    ctx.hf_tiny, shape = tmp / "hf-load-tiny-t5", tmp / "t5-base-shape"
    ctx.hf_models = {(dtype, kind): tmp / f"t5-base-{dtype}-{kind}"
                     for dtype in ctx.args.hf_load_dtypes for kind in HF_FORMATS}
    ctx.hf_parameters = None
    if ctx.args.dry_run:
        return
    log(f"Writing the tiny T5{'' if ctx.hf_data.exists() else ' and WikiHow'} fixture "
        f"(tests/tiny_wikihow.py) to {tmp}")
    write_fixture(ctx, "tiny T5", ["-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                                   "import tiny_wikihow; tiny_wikihow.write_tiny_t5(sys.argv[2]); "
                                   "sys.argv[3:] and tiny_wikihow.write_wikihow(sys.argv[3])",
                                   REPO / "tests", ctx.hf_tiny,
                                   *([] if ctx.hf_data.exists() else [ctx.hf_data])])
    if not ctx.wikihow_dir:
        ctx.env["HF_DATASETS_CACHE"] = str(tmp / "hf_datasets_cache")
    if not shape.exists():  # the lora fixture writes the same, into the same folder
        write_t5_base_shape(ctx, shape)
    for dtype in ctx.args.hf_load_dtypes:
        log(f"Storing it in {dtype}, as safetensors and as a pytorch_model.bin "
            "(benchmarks/hf_memory.py)")
        info = tmp / f"t5-base-{dtype}.json"
        write_fixture(ctx, f"{dtype} t5-base-shaped T5", [
            REPO / "benchmarks" / "hf_memory.py", shape, dtype,
            *(ctx.hf_models[(dtype, kind)] for kind in HF_FORMATS), info])
        ctx.hf_parameters = json.loads(info.read_text())["parameters"]
