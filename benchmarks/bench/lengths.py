"""lengths: variable lengths (world size 2, CPU): padded against token batches, and packed
documents.

T5 at t5-base's shape, the tutorial's lengths (512 + 150 tokens), each example padded to them
(the default) against --max-tokens as many tokens as the padded batch, on the fixture's articles
and on articles whose lengths follow WikiHow's published statistics
(benchmarks/wikihow_lengths.py): samples/s. fsdp2_transformer.py's documents packed
(--pack-documents) against one per row (--pad-documents): useful tokens/s, those of documents,
not padding. The ways take turns.
"""
from . import common, lora
from .common import find, fmt, markdown_table, median, ratio, runs_said
from .fixtures import write_fixture

NAME, ORDER = "lengths", 120
TAKES_TURNS = True
FIXTURES = {"lora"}
# T5 at t5-base's shape with the tutorial's lengths, 2 articles per rank a step (a padded step
# takes about 40 s on a CPU core), one step an epoch; the second epoch's samples/s (the first
# pays for warm-up). --max-tokens: as many tokens as the padded batch holds, so that no
# micro-batch needs more memory than it.
T5_RUN = ["--input-length", "512", "--output-length", "150", "--batch-size", "2",
          "--num-train-samples", "4", "--epochs", "2", "--no-run-validation", "--no-save-model",
          "--mixed-precision", "fp32", "--cpu"]
T5_WAYS = {"padded (the default)": [], "--max-tokens 1324": ["--max-tokens", "1324"]}
T5_DATA = ("the tests' fixture", "WikiHow's lengths")
# fsdp2: a 21M-parameter model on rows of 256 tokens, 8 a step (a step of about 3 s on CPU).
FSDP2_RUN = ["--dim", "512", "--n-layers", "4", "--n-heads", "8", "--vocab-size", "8000",
             "--seq-len", "256", "--batch-size", "8", "--steps", "6", "--log-every", "6",
             "--pack-documents", "--cpu"]
FSDP2_WAYS = {"one document per row (--pad-documents)": ["--pad-documents"],
              "packed (--pack-documents)": []}


def runs(ctx):
    """World size 2 on CPU; its WikiHow-like articles written first."""
    data = {T5_DATA[0]: ctx.lora_data, T5_DATA[1]: ctx.tmp / "wikihow-lengths"}
    if not ctx.args.dry_run:
        common.log("Writing WikiHow-like lengths (benchmarks/wikihow_lengths.py) to "
                   f"{data[T5_DATA[1]]}")
        write_fixture(ctx, "WikiHow-like lengths",
                      [common.REPO / "benchmarks" / "wikihow_lengths.py", data[T5_DATA[1]]])
    configs = [{"device": "cpu", "world_size": 2, "name": f"T5, {name}, {way}",
                "row": f"T5, {name}", "way": way, "samples": 4, "script": "t5_fsdp_finetune.py",
                "args": ["--model-name", str(ctx.lora_model), "--data-dir", str(folder),
                         *T5_RUN, *flags]}
               for name, folder in data.items() for way, flags in T5_WAYS.items()]
    return configs + [{"device": "cpu", "world_size": 2, "name": f"fsdp2, {way}", "row": "fsdp2",
                       "way": way, "script": "fsdp2_transformer.py", "args": [*FSDP2_RUN, *flags]}
                      for way, flags in FSDP2_WAYS.items()]


def figures(config, metrics, stdout, seen):
    if "fsdp2" in config["script"]:
        return {**common.memory_figures(metrics),
                "useful_tokens_per_s": metrics["useful_tokens_per_s"],
                "tokens_per_s": metrics["tokens_per_s"], "train_loss": metrics["train_loss"]}
    return lora.figures(config, metrics=metrics, stdout=stdout, seen=seen)  # steady samples/s


def tables(ctx, configs):
    rows = []
    for name in T5_DATA:
        padded, batched = (find(configs, row=f"T5, {name}", way=way) for way in T5_WAYS)
        rows.append([f"T5, {name}", "samples/s", fmt(median(padded, "samples_per_s"), ".3f"),
                     fmt(median(batched, "samples_per_s"), ".3f"),
                     fmt(ratio(median(batched, "samples_per_s"), median(padded, "samples_per_s")),
                         ".2f")])
    padded, packed = (find(configs, row="fsdp2", way=way) for way in FSDP2_WAYS)
    rows.append(["fsdp2_transformer.py, log-normal documents", "useful tokens/s",
                 fmt(median(padded, "useful_tokens_per_s"), ",.0f"),
                 fmt(median(packed, "useful_tokens_per_s"), ",.0f"),
                 fmt(ratio(median(packed, "useful_tokens_per_s"),
                           median(padded, "useful_tokens_per_s")), ".2f")])
    return ["\n### Variable lengths: padded against token batches and packed documents "
            "(world size 2, CPU, gloo)\n",
            f"T5: {ctx.lora_source.split(', WikiHow')[0].split(', data')[0]}; "
            f"`{' '.join(T5_RUN)}`; data the tests' WikiHow-format fixture (articles of 1-3 "
            "sentences) and benchmarks/wikihow_lengths.py's (log-normal lengths with WikiHow's "
            "published means: articles of about 780 tokens, summaries of 78, 57% of articles "
            "longer than 512); padded: the tutorial's padding to 512 + 150; token batches: "
            f"`{' '.join(T5_WAYS['--max-tokens 1324'])}` (the padded batch's tokens). fsdp2: "
            f"`{' '.join(FSDP2_RUN)}`, documents one per row (`--pad-documents`) or packed; "
            f"useful tokens: those in documents. {runs_said(ctx.args)}, the ways taking turns.\n",
            markdown_table(["run", "figure", "padded", "token batches / packed", "ratio"], rows)]
