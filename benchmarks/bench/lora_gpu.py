"""lora-gpu: the lora benchmark's model and rows at world size 1 on one GPU, with bf16 compute and
longer sequences (512 + 128 tokens, 16 a batch): peak CUDA memory and samples/s."""
import torch

from . import lora
from .common import find, flagged, fmt, markdown_table, median, ratio, runs_said

NAME, ORDER = "lora-gpu", 80
TAKES_TURNS = True
FIXTURES = {"lora"}
# A GPU step of 4 short articles takes milliseconds; these take long enough to time.
SAMPLES, EPOCHS = 256, 3
SIZES = ["--input-length", "512", "--output-length", "128", "--batch-size", "16",
         "--mixed-precision", "bf16"]


def check(args, asked, error):
    if asked and (args.no_gpu or not torch.cuda.is_available()) and not args.dry_run:
        error("lora-gpu runs on a CUDA GPU, and none is visible here")


def runs(ctx):
    """World size 1 on the first GPU."""
    return [{"device": "cuda", "world_size": 1, "name": f"{row}, FSDP{version}", "row": row,
             "fsdp_version": version, "samples": SAMPLES, "script": "t5_fsdp_finetune.py",
             "args": ["--model-name", str(ctx.lora_model), "--data-dir", str(ctx.lora_data),
                      *SIZES, "--num-train-samples", str(SAMPLES), "--epochs", str(EPOCHS),
                      "--no-run-validation", "--no-save-model", *lora.ROWS[row],
                      "--fsdp-version", str(version)]}
            for row in lora.ROWS for version in (1, 2)]


figures = lora.figures


def tables(ctx, configs):
    full = find(configs, row="full fine-tuning", fsdp_version=1)
    headers = ["configuration", "FSDP", "train state (MiB)", "vs full FSDP1",
               "peak CUDA allocated (MiB)", "vs full FSDP1", "train samples/s", "vs full FSDP1"]
    rows = [[flagged(c["row"], c), c["fsdp_version"]]
            + [cell for key, form in (("state_mib", ".1f"), ("peak_mib", ".0f"),
                                      ("samples_per_s", ".1f"))
               for cell in (fmt(median(c, key), form),
                            fmt(ratio(median(c, key), median(full, key)), ".3f"))]
            for c in configs]
    return ["\n### T5: LoRA against full fine-tuning on one GPU (NCCL, world size 1)\n",
            f"{ctx.lora_source}. `{' '.join(SIZES)} --num-train-samples {SAMPLES} --epochs "
            f"{EPOCHS} --no-run-validation`; LoRA `{' '.join(lora.LORA)}` on q,v, the bf16 base "
            f"with `--base-dtype bf16`; {runs_said(ctx.args)}, the configurations taking turns. "
            f"Train samples/s is {SAMPLES} / the median epoch after the first.\n",
            markdown_table(headers, rows)]
