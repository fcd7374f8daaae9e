"""lora: LoRA against full fine-tuning (world size 2, CPU, fp32 compute: 33 minutes on 2 cores).

A t5-base-shaped T5 (198M parameters, random weights, written by tests/tiny_wikihow.py), full
fine-tuning and LoRA (rank 16 on q,v) with an fp32 and a bf16 base, under FSDP1 and FSDP2; and
full fine-tuning with AdamW(foreach=True) and AdamW(fused=True), from copies of the script with
that one line changed. Its runs take turns. Before them, the script's --plan for every
configuration at 1-64 ranks; --lora-plot draws them with the measured runs (matplotlib).
"""
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

from . import common
from .common import find, flagged, fmt, markdown_table, median, ratio, runs_said

NAME, ORDER = "lora", 70
TAKES_TURNS = True
FIXTURES = {"lora"}
T5_BASE_VOCAB = 32128  # t5-base's own: the picture's dotted lines (--plan needs a config only)
# 8 articles are one step of 4 per rank: each epoch is one optimizer step (CPU steps of a 198M
# model take seconds); samples/s is taken over the epochs after the first (warm-up, FSDP2's lazy
# initialization), validation off.
TRAIN_SAMPLES, EPOCHS = 8, 4
SIZES = ["--input-length", "64", "--output-length", "24", "--batch-size", "4",
         "--mixed-precision", "fp32", "--cpu"]  # the runs' and the plans' (batch per rank)
RUN = ["--num-train-samples", str(TRAIN_SAMPLES), "--epochs", str(EPOCHS),
       "--no-run-validation", "--no-save-model"]
LORA = ["--lora-rank", "16"]  # the script's defaults otherwise: alpha 16, dropout 0.05, q,v
ROWS = {"full fine-tuning": [], "LoRA, fp32 base": LORA,
        "LoRA, bf16 base": [*LORA, "--base-dtype", "bf16"]}
# The AdamW rows run a copy of t5_fsdp_finetune.py whose optimizer line (fused on CUDA only) ends in
# this, changed to pass foreach=True or fused=True (CPU AdamW steps tensor by tensor by default).
ADAMW_LINE_END = 'lr=args.lr, fused=device.type == "cuda")'
ADAMW_VARIANTS = ("foreach", "fused")
# The picture's curves: --plan's flags beside SIZES, and how each is drawn.
CURVES = {f"{row}, FSDP{version} FULL_SHARD": [*flags, "--fsdp-version", str(version)]
          for row, flags in ROWS.items() for version in (1, 2)}
CURVES.update({"full fine-tuning, FSDP1 SHARD_GRAD_OP": ["--sharding-strategy", "SHARD_GRAD_OP"],
               "full fine-tuning, FSDP1 NO_SHARD (as DDP)": ["--sharding-strategy", "NO_SHARD"]})
CURVE_COLOURS = {"full fine-tuning": "tab:blue", "LoRA, fp32 base": "tab:green",
                 "LoRA, bf16 base": "tab:purple", "SHARD_GRAD_OP": "tab:orange",
                 "NO_SHARD": "black"}
PLAN_WORLD_SIZES = (1, 2, 4, 8, 16, 32, 64)
VOCAB_MODEL = f"vocab {T5_BASE_VOCAB}"


def add_flags(group):
    add = group.add_argument
    add("--lora-adamw", nargs="*", choices=ADAMW_VARIANTS, default=list(ADAMW_VARIANTS),
        metavar="OPTION", help="lora: full fine-tuning also with AdamW(OPTION=True), any of "
        f"{', '.join(ADAMW_VARIANTS)} (none: no such rows)")
    add("--lora-plot", default=None, metavar="PNG",
        help="lora: draw memory per rank against world size (--plan, and the measured runs) "
             "into PNG; needs matplotlib (benchmarks/requirements.txt)")


def check(args, asked, error):
    if asked and args.lora_plot and not args.dry_run:
        try:
            import matplotlib  # noqa: F401  (drawn by t5_memory.py, after the runs)
        except ImportError:
            error("--lora-plot needs matplotlib: pip install -r benchmarks/requirements.txt")


def adamw_copy(folder, option):
    """A copy of t5_fsdp_finetune.py (and the modules it imports) in folder whose AdamW takes
    option=True; None when the script's optimizer line is not the one expected."""
    text = (common.REPO / "t5_fsdp_finetune.py").read_text()
    lines = [line for line in text.splitlines()
             if "optim.AdamW(" in line and line.endswith(ADAMW_LINE_END)]
    if len(lines) != 1:
        return None
    folder.mkdir()
    shutil.copy(common.REPO / "summarization_dataset.py", folder)
    shutil.copytree(common.REPO / "safeguards", folder / "safeguards",
                    ignore=shutil.ignore_patterns("__pycache__"))
    changed = lines[0].replace('fused=device.type == "cuda"', f"{option}=True")
    (folder / "t5_fsdp_finetune.py").write_text(text.replace(lines[0], changed))
    return folder / "t5_fsdp_finetune.py"


def runs(ctx):
    """World size 2 on CPU: each row under FSDP1 and FSDP2, then the AdamW copies'."""
    rows = [(row, version, None, "t5_fsdp_finetune.py") for row in ROWS for version in (1, 2)]
    for option in ctx.args.lora_adamw:
        script = adamw_copy(ctx.tmp / f"adamw-{option}", option)
        if script is None:
            common.log(f"error: t5_fsdp_finetune.py has no single optim.AdamW(...) line ending in "
                f"{ADAMW_LINE_END!r} any more: update ADAMW_LINE_END in benchmarks/bench/lora.py,"
                " or pass --lora-adamw with nothing")
            sys.exit(1)
        rows += [("full fine-tuning", version, option, str(script)) for version in (1, 2)]
    return [{"device": "cpu", "world_size": 2,
             "name": f"{row}, FSDP{version}" + (f", AdamW({adamw}=True)" if adamw else ""),
             "row": row, "fsdp_version": version, "adamw": adamw, "samples": TRAIN_SAMPLES,
             "curve": f"{row}, FSDP{version} FULL_SHARD", "script": script,
             "args": ["--model-name", str(ctx.lora_model), "--data-dir", str(ctx.lora_data),
                      *SIZES, *RUN, *ROWS[row], "--fsdp-version", str(version)]}
            for row, version, adamw, script in rows]


def plan_models(ctx):
    """What --plan reads (a config.json): the measured model, and unless --lora-model, the same
    with t5-base's own vocabulary."""
    if ctx.args.lora_model:
        return {"measured": ctx.lora_model}
    return {"measured": ctx.lora_model, VOCAB_MODEL: ctx.tmp / "t5-base-vocab"}


def prepare(ctx):
    """--plan for every curve at every world size, for each model, into ctx.lora_plans: before
    the runs, so that a --plan that fails, fails in seconds. --dry-run: its commands, a line a
    curve."""
    models = plan_models(ctx)
    if ctx.args.dry_run:
        sizes = " ".join(map(str, PLAN_WORLD_SIZES))  # one line per curve, not 7
        return [f"{shlex.join(plan_command(models[model], curve, 'N'))}  # N in {sizes}"
                for model in models for curve in CURVES]
    if VOCAB_MODEL in models:
        config = json.loads((ctx.lora_model / "config.json").read_text())
        models[VOCAB_MODEL].mkdir()
        (models[VOCAB_MODEL] / "config.json").write_text(
            json.dumps({**config, "vocab_size": T5_BASE_VOCAB}))
    keys = [(model, curve, world_size) for model in models for curve in CURVES
            for world_size in PLAN_WORLD_SIZES]
    argvs = [plan_command(models[model], curve, world_size)[2:]
             for model, curve, world_size in keys]
    common.log(f"--plan for {len(argvs)} configurations (benchmarks/t5_memory.py)")
    (ctx.tmp / "plan-runs.json").write_text(json.dumps(argvs))
    proc = subprocess.run([sys.executable, common.REPO / "benchmarks" / "t5_memory.py",
                           common.REPO / "t5_fsdp_finetune.py", ctx.tmp / "plan-runs.json",
                           ctx.tmp / "plans.json"], cwd=ctx.tmp, env=ctx.env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        common.log(f"error: --plan failed:\n{common.stderr_tail(proc.stderr)}")
        sys.exit(1)
    ctx.lora_plans = dict(zip(keys, json.loads((ctx.tmp / "plans.json").read_text())))
    return []


def plan_command(model, curve, world_size):
    """python SCRIPT --plan ... for one curve at one world size."""
    return ["python", str(common.REPO / "t5_fsdp_finetune.py"), "--plan", "--world-size",
            str(world_size), "--model-name", str(model), *SIZES, *CURVES[curve]]


def figures(config, metrics, stdout, seen):
    """The steady samples/s (the epochs after the first) and the memory after loading (lora-gpu's
    and lengths' T5 runs too)."""
    found = common.memory_figures(metrics)
    found["epoch_s"] = common.steady_epoch_time(metrics["epoch_times"])
    found["samples_per_s"] = config["samples"] / found["epoch_s"]
    found["loaded_mib"] = max(metrics["peak_memory_after_loading_per_rank"]) / common.MIB
    return found


def tables(ctx, configs):
    plans, args = ctx.lora_plans, ctx.args
    full = {version: find(configs, row="full fine-tuning", fsdp_version=version, adamw=None)
            for version in (1, 2)}
    parameters = plans[("measured", next(iter(CURVES)), 1)]["parameters"]
    headers = ["configuration", "FSDP", "train state / rank (MiB)", "vs full FSDP1",
               "--plan's train state (MiB)", "RSS after loading / rank (MiB)",
               "peak RSS / rank (MiB)", "vs full FSDP1", "train samples/s", "vs full FSDP1"]
    rows = []
    for c in (c for c in configs if not c["adamw"]):
        planned = plans[("measured", c["curve"], 2)]["train_state_bytes"] / common.MIB
        rows.append([flagged(c["row"], c), c["fsdp_version"], fmt(median(c, "state_mib"), ".1f"),
                     fmt(ratio(median(c, "state_mib"), median(full[1], "state_mib")), ".3f"),
                     f"{planned:.1f}", fmt(median(c, "loaded_mib"), ".0f"),
                     fmt(median(c, "peak_mib"), ".0f"),
                     fmt(ratio(median(c, "peak_mib"), median(full[1], "peak_mib")), ".2f"),
                     fmt(median(c, "samples_per_s"), ".3f"),
                     fmt(ratio(median(c, "samples_per_s"), median(full[1], "samples_per_s")),
                         ".2f")])
    out = ["\n### T5: LoRA against full fine-tuning, FSDP1 and FSDP2 (CPU, gloo)\n",
           f"{ctx.lora_source}: {parameters:,} parameters. World size 2, `{' '.join(SIZES)} "
           f"{' '.join(RUN)}`; LoRA `{' '.join(LORA)}` on q,v (alpha 16, dropout 0.05), the "
           f"bf16 base with `--base-dtype bf16`; {runs_said(args)}, the configurations taking "
           "turns. Each epoch is one optimizer step of 4 articles per rank; train samples/s is "
           f"{TRAIN_SAMPLES} / the median epoch after the first. --plan's train state is what "
           "`--plan` predicts for the same flags; RSS after loading is each rank's peak once the "
           "model is loaded and sharded, before training.\n",
           markdown_table(headers, rows)]
    if args.lora_adamw:
        out += adamw_table(args, configs, full)
    if args.lora_plot:
        out += picture(ctx, configs, parameters)
    return out


def adamw_table(args, configs, full):
    """FSDP2 against FSDP1, and AdamW's foreach and fused, full fine-tuning."""
    headers = ["FSDP", "AdamW", "time / step (s)", "train samples/s", "vs FSDP1, default AdamW",
               "vs FSDP1, same AdamW", "vs the same FSDP, default AdamW", "peak RSS / rank (MiB)"]
    rows = []
    for version in (1, 2):
        for adamw in (None, *args.lora_adamw):
            c, fsdp1 = (find(configs, row="full fine-tuning", fsdp_version=v, adamw=adamw)
                        for v in (version, 1))
            rows.append([version, flagged("default (on CPU: one tensor at a time)"
                                          if adamw is None else f"{adamw}=True", c),
                         fmt(median(c, "epoch_s"), ".2f"), fmt(median(c, "samples_per_s"), ".3f")]
                        + [fmt(ratio(median(c, "samples_per_s"),
                                     median(baseline, "samples_per_s")), ".2f")
                           for baseline in (full[1], fsdp1, full[version])]
                        + [fmt(median(c, "peak_mib"), ".0f")])
    return ["\n### T5: FSDP2 against FSDP1, and AdamW's foreach and fused (CPU, gloo)\n",
            "Full fine-tuning, as in the table above; the foreach and fused rows run a copy of "
            "t5_fsdp_finetune.py (written into the harness's temporary folder) whose "
            "`optim.AdamW(...)` also passes `foreach=True` or `fused=True`. A step is one "
            f"epoch (the median after the first); {runs_said(args)}, all rows taking turns.\n",
            markdown_table(headers, rows)]


def picture(ctx, configs, parameters):
    """--lora-plot: --plan's curves and the measured runs drawn (benchmarks/t5_memory.py), and
    the markdown that shows it. A picture that fails must not take the tables with it: it counts
    as a failure, said at the end."""
    args, plans, models = ctx.args, ctx.lora_plans, plan_models(ctx)
    curves = []
    for model, width, dots in (("measured", 2, None), (VOCAB_MODEL, 1, ":")):
        if model not in models:
            continue
        for curve in CURVES:
            planned = [plans[(model, curve, n)] for n in PLAN_WORLD_SIZES]
            colour = next(v for k, v in reversed(CURVE_COLOURS.items()) if k in curve)
            curves.append({"label": curve, "colour": colour, "linewidth": width,
                           "linestyle": dots or ("--" if "FSDP2" in curve else "-"),
                           "in_legend": model == "measured", "world_sizes": PLAN_WORLD_SIZES,
                           "train_state": [plan["train_state_bytes"] for plan in planned],
                           "peak": [plan["peak_bytes"] for plan in planned]})
    if len(models) > 1:  # the dotted lines' legend entry
        vocab = plans[(VOCAB_MODEL, next(iter(CURVES)), 1)]
        curves.append({"label": f"dotted: t5-base's own {T5_BASE_VOCAB:,}-token vocabulary "
                       f"({vocab['parameters'] / 1e6:.1f}M parameters)", "colour": "gray",
                       "linestyle": ":", "linewidth": 1, "world_sizes": [], "train_state": [],
                       "peak": []})
    measured = [{"label": c["name"], "colour": curve["colour"], "world_size": 2,
                 "train_state": median(c, "state_mib") * common.MIB,
                 "peak": median(c, "peak_mib") * common.MIB}
                for c in configs if not c["adamw"] and median(c, "state_mib") is not None
                for curve in curves if curve["label"] == c["curve"]]
    from t5_memory import draw  # benchmarks/, beside run.py

    shape = Path(str(ctx.lora_model)).name if args.lora_model else "t5-base's shape"
    try:
        draw(args.lora_plot,
             title=f"T5, {shape} ({parameters / 1e6:.1f}M parameters): memory per rank, AdamW, "
                   "fp32 compute, batch 4 x (64 + 24) tokens per rank",
             curves=curves, measured=measured,
             note="Lines: the script's --plan at each world size (the training state exact, the "
                  "peak an estimate of the device memory training needs). FULL_SHARD and "
                  "SHARD_GRAD_OP, FSDP1 and FSDP2 hold the same training state: their lines lie "
                  "on each other (FSDP2's pads each tensor: a little more at 32-64 ranks). "
                  "Markers: measured at world size 2 on CPU, where the peak RSS also holds "
                  "Python, torch and the whole model each rank loads before sharding.")
    except Exception as e:
        common.log(f"error: the picture {args.lora_plot} could not be drawn: {e!r}")
        ctx.failures.append({"benchmark": NAME, "device": "cpu", "world_size": "1-64",
                             "name": "picture", "repeat": "-", "error": repr(e)})
    link = os.path.relpath(args.lora_plot, Path(args.out).parent if args.out else ".")
    return [f"\n![Memory per rank against world size: --plan's curves and the measured runs]"
            f"({link})\n"]
