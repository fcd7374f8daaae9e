"""cpu-memory: memory returned on CPU (world size 2, CPU: 12 minutes on 2 cores).

Each script as it runs by default (glibc keeps freed memory for reuse) and with
--return-freed-memory (its mmap threshold fixed at 256 KiB), taking turns: each rank's peak
RssAnon, and for T5 its rise above the level after loading, at t5-base's shape with LoRA too.
"""
from hf_memory import rss_anon_peaks  # benchmarks/, beside run.py

from . import common, lora, t5
from .common import find, flagged, fmt, markdown_table, median, ratio, runs_said

NAME, ORDER = "cpu-memory", 110
TAKES_TURNS = True
FIXTURES = {"mnist", "t5", "lora"}
# "kept": glibc's default; "returned": --return-freed-memory
WAYS = {"kept (the default)": [], "returned (--return-freed-memory)": ["--return-freed-memory"]}
LOADED = "Peak memory per rank after loading the model"  # T5's line: the level after loading


def runs(ctx):
    """World size 2 on CPU, each row both ways."""
    t5_run = ["--data-dir", str(ctx.wikihow_dir), "--no-save-model", "--cpu"]
    lora_run = ["--model-name", str(ctx.lora_model), "--data-dir", str(ctx.lora_data),
                *lora.SIZES, *lora.RUN, *lora.LORA]
    mnist_run = ["--data-dir", str(ctx.mnist_dir), "--epochs", "1", "--cpu"]
    rows = {"MNIST, DDP": ("ddp_mnist.py", mnist_run),
            "MNIST, FSDP1": ("fsdp1_mnist.py", mnist_run),
            "FSDP2, its defaults": ("fsdp2_transformer.py", ["--cpu"]),
            "T5, tiny, FSDP1": ("t5_fsdp_finetune.py", ["--model-name", str(ctx.t5_model),
                                                        *t5_run, *t5.SIZES]),
            "T5, t5-base's shape, LoRA, FSDP1": ("t5_fsdp_finetune.py", lora_run),
            "T5, t5-base's shape, LoRA, FSDP2": ("t5_fsdp_finetune.py",
                                                 [*lora_run, "--fsdp-version", "2"])}
    return [{"device": "cpu", "world_size": 2, "name": f"{row}, {way}", "row": row, "way": way,
             "script": script, "args": [*flags, *way_flags]}
            for row, (script, flags) in rows.items() for way, way_flags in WAYS.items()]


def run(config, command, workdir, env, timeout):
    """Each rank's RssAnon over the whole run; T5's from the line after loading on."""
    returncode, stdout, stderr, peaks, _, bases = rss_anon_peaks(
        command, workdir, "\0", env=env, timeout=timeout,
        start=LOADED if "t5" in config["script"] else None)
    return returncode, stdout, stderr, {"peaks": peaks, "bases": bases}


def figures(config, metrics, stdout, seen):
    peaks = seen["peaks"]
    found = {**common.memory_figures(metrics), "train_loss": metrics["train_loss"],
             "wall_s": metrics["wall_s"]}
    if sorted(peaks) != list(range(config["world_size"])):
        raise ValueError(f"RssAnon was sampled for ranks {sorted(peaks)}")
    found["rss_anon_mib"] = max(peaks.values()) / common.MIB
    found["above_loaded_mib"] = (max(peaks[rank] - base for rank, base in seen["bases"].items())
                                 / common.MIB if "t5" in config["script"] else None)
    return found


def tables(ctx, configs):
    headers = ["run (world size 2, CPU)", "peak RssAnon / rank, kept (MiB)", "returned (MiB)",
               "returned / kept", "T5: rise after loading, kept (MiB)", "returned (MiB)",
               "returned / kept", "same train loss", "wall s, kept", "returned"]
    rows = []
    for row in dict.fromkeys(c["row"] for c in configs):
        kept, returned = (find(configs, row=row, way=way) for way in WAYS)
        same = (median(kept, "train_loss") == median(returned, "train_loss")
                if median(kept, "train_loss") is not None else None)
        rows.append([flagged(row, kept, returned),
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
    return ["\n### Memory returned on CPU: glibc's default against --return-freed-memory "
            "(CPU, gloo)\n",
            f"{ctx.lora_source}; the other rows: {ctx.mnist_source or 'MNIST'}, FSDP2's "
            f"defaults, {ctx.t5_source or 'the tiny T5'} with `{' '.join(t5.SIZES)}`. LoRA rows: "
            f"`{' '.join([*lora.SIZES, *lora.RUN, *lora.LORA])}`. Kept: the scripts' default, "
            "glibc's (it raises its mmap threshold to the largest block freed, up to 32 MiB, and "
            "keeps what is freed below it); returned: --return-freed-memory (256 KiB, fixed). "
            "Each rank's RssAnon (anonymous memory) is sampled every 10 ms: its peak over the "
            f"whole run, for T5 from the line '{LOADED}' on, and for T5 the rise of that peak "
            "above the first sample after that line (the level after loading); the maximum over "
            f"ranks; {runs_said(ctx.args)}, the two ways taking turns. Wall s: the training's, "
            "from the metrics file.\n",
            markdown_table(headers, rows)]
