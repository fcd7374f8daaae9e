"""t5_fsdp_finetune.py --lora-rank: LoRA adapters (PEFT) on the frozen tiny T5, under FSDP2 and
FSDP1, on CPU (gloo). The runs use the dropout-free T5 and adapters without dropout, in the same
global batch at every world size (conftest.lora_args): every layout gives the same losses."""
import glob
import json
import math
import shutil
import sys

import pytest
from conftest import (
    REPO,
    T5_INPUT_LENGTH,
    T5_OUTPUT_LENGTH,
    T5_VAL_SAMPLES,
    cached_t5_runs,
    full_state_of,
    greedy_summaries,
    lora_args,
    plan_of,
    queue_cached_run,
    validation_loss,
    warning_lines,
)

sys.path.insert(0, str(REPO))  # where summarization_dataset is (open_exports)

SCRIPT = "t5_fsdp_finetune.py"
BASE = "base_model.model."  # the prefix of the base model's names in a PeftModel's state dict


@pytest.fixture
def lora_run(cached_torchrun, still_t5_dir, wikihow_dir):
    """lora_run(ranks, *args): a cached LoRA run on `ranks` ranks (FSDP1 unless args say 2)."""
    return cached_t5_runs(cached_torchrun,
                          lambda ranks, *args: lora_args(still_t5_dir, wikihow_dir, ranks, *args))


# The runs besides the reference (FSDP2, 2 ranks, fp32 base, sharded checkpoints and exports):
# FSDP1 on 2 ranks (its exports too), FSDP1 on one process (NO_SHARD), and a bf16 base under each
# version, with the options that must keep working beside LoRA.
FSDP1 = []
ONE_PROCESS = ["--no-save-model"]
BF16_FSDP2 = ["--fsdp-version", 2, "--base-dtype", "bf16", "--cpu-ram-efficient-loading",
              "--activation-checkpointing"]
BF16_FSDP1 = ["--base-dtype", "bf16", "--mixed-precision", "bf16", "--sharding-strategy",
              "SHARD_GRAD_OP", "--no-save-model"]


# --compile (FSDP2) on one process (its mesh of one rank still all-gathers and reshards around each
# compiled block; 2 ranks would compile the same graphs twice over: 178 CPU-s against 129), without
# validation (its forward would compile graphs of its own)
COMPILED = ["--fsdp-version", 2, "--compile", "--no-run-validation", "--no-save-model"]
COMPILED_TEST = "test_compiled_blocks_train_the_losses_of_eager_and_compile_once"


def start_early(request):
    """Queue the compiled run as the session starts, at the lowest priority (conftest): compiling
    (C++ on CPU) takes most of its two minutes, on the cores the other tests leave idle; its test,
    which runs last with this file's, waits for it."""
    if any(getattr(item, "originalname", None) == COMPILED_TEST for item in request.session.items):
        still, wikihow = (request.getfixturevalue(name) for name in ("still_t5_dir", "wikihow_dir"))
        queue_cached_run(request, SCRIPT, *lora_args(still, wikihow, 1, *COMPILED), nproc=1)


def adapted_modules(still_t5_dir, targets=("q", "v")):
    """{name: Linear} of the tiny T5's modules that --lora-targets names (PEFT matches the last
    part of a module's name: "q" is every attention's q), and the parameters of the model."""
    from transformers import T5ForConditionalGeneration

    model = T5ForConditionalGeneration.from_pretrained(still_t5_dir)
    return ({name: m for name, m in model.named_modules() if name.split(".")[-1] in targets},
            sum(p.numel() for p in model.parameters()))


def adapters_and_base(still_t5_dir, targets=("q", "v")):
    """(parameters of the frozen base, of the adapters, adapter tensors) of the tiny T5 with
    LoRA rank 8 on targets (q and v): two matrices, rank x in and out x rank, beside each."""
    modules, base = adapted_modules(still_t5_dir, targets)
    adapters = sum(8 * (m.in_features + m.out_features) for m in modules.values())
    return base, adapters, 2 * len(modules)


def tensor_names(path):
    """The names of the tensors in a safetensors file, read from its header."""
    with open(path, "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return {name for name in header if name != "__metadata__"}


def lora_line(base, adapters, dtype="float32"):
    """The line a LoRA run prints about what trains."""
    return (f"LoRA: {adapters:,} of {base + adapters:,} parameters train "
            f"({100 * adapters / (base + adapters):.2f}%), the adapters; the base is frozen, "
            f"in {dtype}")


def test_lora_trains_alike_under_fsdp2_fsdp1_and_one_process(lora_reference, lora_run,
                                                             still_t5_dir):
    """FSDP2 and FSDP1 on 2 ranks and FSDP1 on one process (NO_SHARD) train the same adapters:
    every epoch's train and validation loss within 1e-5 of one process's, falling, no warning;
    each says how many parameters train."""
    runs = {"FSDP2": lora_reference, "FSDP1": lora_run(2, *FSDP1),
            "one process": lora_run(1, *ONE_PROCESS)}
    base, adapters, tensors = adapters_and_base(still_t5_dir)
    one = runs["one process"].metrics
    for name, run in runs.items():
        assert warning_lines(run.output) == [], name
        assert lora_line(base, adapters) in run.stdout.splitlines(), run.stdout
        for key in ("train_losses", "val_losses"):
            assert run.metrics[key] == pytest.approx(one[key], rel=1e-5), (name, key)
    assert one["val_losses"][1] < one["val_losses"][0]
    assert (runs["FSDP2"].metrics["fsdp_version"], runs["FSDP1"].metrics["fsdp_version"]) == (2, 1)
    # FSDP1 leaves the adapters whole, out of its units (an A and a B beside each q and v)
    whole = f"{tensors} LoRA adapter matrices, {adapters:,} parameters: whole on every rank"
    assert any(whole in line for line in runs["FSDP1"].stdout.splitlines()), runs["FSDP1"].stdout


def test_compiled_blocks_train_the_losses_of_eager_and_compile_once(lora_run):
    """--compile (FSDP2, each T5Block compiled before sharding) trains eager's adapters: each
    epoch's train loss within 1e-6 of the eager one-process run's (the dropout-free T5: fused
    kernels round differently, nothing random), every block compiled, its graphs all in epoch 1
    (the encoder's and the decoder's shapes, whose lengths differ, then nothing: no recompile after
    the first steps). Without validation: the validation forward would compile graphs of its own,
    and CPU compilation (C++) takes most of the run's time."""
    run = lora_run(1, *COMPILED)
    assert warning_lines(run.output) == []
    assert any(line.startswith("Blocks compiled: 4 of 4 (torch.compile, in place)")
               for line in run.stdout.splitlines())
    graphs = run.metrics["compiled_graphs_per_epoch"]
    assert len(graphs) == 2 and graphs[0] > 0 and graphs[1] == 0, graphs
    assert "Graphs compiled in epoch 2: 0" in run.stdout.splitlines(), run.stdout
    assert run.metrics["train_losses"] == pytest.approx(
        lora_run(1, *ONE_PROCESS).metrics["train_losses"], rel=1e-6)


def test_only_the_adapters_train(lora_reference, still_t5_dir):
    """The FSDP2 run's merged export, written shard by shard, and its adapters: every weight
    without adapters is bit-identical to the pretrained one; each q and v is the pretrained
    weight plus alpha / r times its adapters' product B A (merged by each rank for its rows), and
    every B, which PEFT starts at zero, has moved."""
    import torch
    from safetensors.torch import load_file
    from transformers import T5ForConditionalGeneration

    pretrained = T5ForConditionalGeneration.from_pretrained(still_t5_dir).state_dict()
    merged = {name: tensor for file in sorted(glob.glob(
        f"{lora_reference.metrics['checkpoint']}/*.safetensors"))
        for name, tensor in load_file(file).items()}
    adapters = load_file(f"{lora_reference.metrics['adapter']}/adapter_model.safetensors")
    adapted = {name.removeprefix(BASE).replace(".lora_A.weight", ".weight"): name
               for name in adapters if ".lora_A." in name}
    assert len(adapted) == 12 and set(adapted) <= set(merged)  # 12 q and v
    assert [k for k, v in merged.items() if k not in adapted and not torch.equal(
        v, pretrained[k])] == []
    for weight, a in adapted.items():
        b = adapters[a.replace("lora_A", "lora_B")]
        product = 16 / 8 * b @ adapters[a]
        assert b.abs().max() > 0 and product.abs().max() > 1e-4
        assert torch.allclose(merged[weight], pretrained[weight] + product, atol=1e-6), weight


def open_exports(base_dir, data_dir, exports):
    """Each run's exports opened as a user would, in a plain Python (the test's own: no torchrun,
    no FSDP): for each (merged HF directory, adapter directory) pair in exports, the validation
    loss of the merged model (from_pretrained) and of the adapters put on the pretrained base
    (PeftModel.from_pretrained), its dtype, and the adapters' greedy summaries (every article's,
    in batches of 4: as the run generates them)."""
    from peft import PeftModel
    from transformers import T5ForConditionalGeneration, T5Tokenizer

    from summarization_dataset import wikihow

    tokenizer = T5Tokenizer.from_pretrained(base_dir)
    val = wikihow(tokenizer, "validation", T5_VAL_SAMPLES, T5_INPUT_LENGTH, T5_OUTPUT_LENGTH,
                  data_dir=data_dir)

    results = []
    for merged, adapter in zip(exports[::2], exports[1::2]):
        opened = T5ForConditionalGeneration.from_pretrained(merged)
        # the base in the dtype it trained in
        base = T5ForConditionalGeneration.from_pretrained(base_dir, dtype=opened.dtype)
        with_adapters = PeftModel.from_pretrained(base, adapter)
        results.append({"merged": validation_loss(opened, val), "dtype": str(opened.dtype),
                        "adapter": validation_loss(with_adapters, val),
                        "summaries": greedy_summaries(with_adapters, tokenizer, val,
                                                      max_new_tokens=T5_OUTPUT_LENGTH)})
    return results


# PEFT (0.21) reads transformers 5's deprecated is_gradient_checkpointing as it puts adapters on
# (t5_fsdp_finetune.quiet_known_warnings says so to the script's users). Remove with it.
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_exports_open_and_give_the_logged_loss(lora_reference, lora_run, still_t5_dir,
                                               wikihow_dir):
    """Each run's best model, exported both ways: the PEFT adapter directory
    (adapter_config.json, adapter_model.safetensors) that PeftModel.from_pretrained puts on the
    pretrained model, and the merged HF directory that from_pretrained opens without PEFT; both
    give the logged validation loss (within 1e-4; with a bf16 base, in bf16, 1e-3). The
    reference's (--rouge) adapters write, token for token, the summaries that its 2 ranks
    generated in that epoch with the adapters of the sharded model."""
    runs = [lora_reference, lora_run(2, *FSDP1), lora_run(2, *BF16_FSDP2)]
    exports = [path for run in runs for path in (run.metrics["checkpoint"],
                                                 run.metrics["adapter"])]
    for run, result in zip(runs, open_exports(still_t5_dir, wikihow_dir, exports)):
        bf16 = run.metrics["lora"]["base_dtype"] == "bf16"
        assert result["dtype"] == ("torch.bfloat16" if bf16 else "torch.float32"), result
        for export in ("adapter", "merged"):
            assert result[export] == pytest.approx(run.metrics["val_loss"],
                                                   abs=1e-3 if bf16 else 1e-4), result
        best = [generated for generated in run.metrics["rouge_per_epoch"]  # the exported epoch's
                if run.metrics["checkpoint"].endswith(f"-{generated['epoch']}-%.4f-hf"
                                                      % run.metrics["val_loss"])]
        assert len(best) == (run is lora_reference)
        for generated in best:
            with open(generated["predictions"], encoding="utf-8") as f:
                assert result["summaries"] == [json.loads(line)["generated"] for line in f]
        adapter = run.metrics["adapter"]
        with open(f"{adapter}/adapter_config.json") as f:
            config = json.load(f)
        assert config["r"] == 8 and sorted(config["target_modules"]) == ["q", "v"]
        assert config["base_model_name_or_path"] == str(still_t5_dir)
        assert len(tensor_names(f"{adapter}/adapter_model.safetensors")) == 24  # 12 Linears' A, B


# Adapters on modules other than the default q and v, in attention (k, o) and in the MLP (wi, wo).
OTHER_TARGETS = ["k", "o", "wi", "wo"]


def test_adapters_sit_exactly_on_the_lora_targets(lora_run, still_t5_dir, tmp_path):
    """--lora-targets k,o,wi,wo (FSDP1, which exports through PEFT's save_pretrained): the exported
    adapter names exactly those modules, in adapter_config.json and in its tensors (an A and a B
    beside every k, o, wi and wo, none beside q or v), and the run trains that many adapters: the
    parameters it says train, and its training state to the byte, which --plan predicts."""
    run = lora_run(2, "--lora-targets", ",".join(OTHER_TARGETS))
    assert warning_lines(run.output) == []
    adapter = run.metrics["adapter"]
    with open(f"{adapter}/adapter_config.json") as f:
        assert sorted(json.load(f)["target_modules"]) == sorted(OTHER_TARGETS)
    modules, _ = adapted_modules(still_t5_dir, OTHER_TARGETS)
    assert len(modules) == 20  # k and o of 6 attentions, wi and wo of 4 MLPs (2 + 2 blocks)
    assert tensor_names(f"{adapter}/adapter_model.safetensors") == {
        f"{BASE}{name}.lora_{matrix}.weight" for name in modules for matrix in "AB"}
    base, adapters, tensors = adapters_and_base(still_t5_dir, OTHER_TARGETS)
    assert lora_line(base, adapters) in run.stdout.splitlines(), run.stdout
    expected = base * 4 // 2 + adapters * (4 + 4 + 8) + 4 * tensors  # as for q and v, below
    assert run.metrics["train_state_bytes"] == expected
    assert run.metrics["lora"]["targets"] == sorted(OTHER_TARGETS)
    plan = plan_of(SCRIPT, tmp_path, "--model-name", still_t5_dir, "--world-size", 2,
                   "--lora-rank", 8, "--lora-targets", ",".join(OTHER_TARGETS))
    assert (plan["train_state_bytes"], plan["trained_parameters"]) == (expected, adapters)


def test_lora_dropout_takes_effect(lora_reference, lora_run):
    """The reference run (FSDP2, a dropout-free base, --lora-dropout 0) with --lora-dropout 0.1:
    dropout on the adapters' input changes every epoch's losses, the run still learns, and its
    exported adapter and its checkpoints record 0.1."""
    run = lora_run(2, "--fsdp-version", 2, "--checkpoint-type", "sharded", "--lora-dropout", 0.1)
    assert warning_lines(run.output) == []
    reference = lora_reference.metrics
    for key in ("train_losses", "val_losses"):
        for epoch, (loss, without) in enumerate(zip(run.metrics[key], reference[key]), 1):
            assert loss != pytest.approx(without, rel=1e-6), (key, epoch)
    assert run.metrics["val_losses"][1] < run.metrics["val_losses"][0]
    with open(f"{run.metrics['adapter']}/adapter_config.json") as f:
        assert json.load(f)["lora_dropout"] == 0.1
    with open(run.cwd / "checkpoint-epoch-1" / "trainer_state.json") as f:
        assert json.load(f)["lora"]["dropout"] == run.metrics["lora"]["dropout"] == 0.1


@pytest.mark.gpu
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_on_one_gpu(torchrun, still_t5_dir, wikihow_dir):
    """World size 1 on a GPU, bf16 compute on a bf16 base: FSDP2 (read shard by shard, activation
    checkpointing) and FSDP1 learn, and both exports give the logged validation loss on CPU
    (within 2e-2: computed there in bf16 without autocast)."""
    runs = []
    for options in ([*BF16_FSDP2, "--mixed-precision", "bf16"], BF16_FSDP1[:-1]):  # with exports
        run = torchrun(SCRIPT, *lora_args(still_t5_dir, wikihow_dir, 1, *options), nproc=1)
        assert run.returncode == 0, run.output
        assert run.metrics["device"] == "cuda" and warning_lines(run.output) == []
        assert run.metrics["val_losses"][-1] < run.metrics["val_losses"][0]
        runs.append(run)
    exports = [run.metrics[key] for run in runs for key in ("checkpoint", "adapter")]
    for run, result in zip(runs, open_exports(still_t5_dir, wikihow_dir, exports)):  # on CPU
        for export in ("adapter", "merged"):
            assert result[export] == pytest.approx(run.metrics["val_loss"], abs=2e-2), result


@pytest.mark.parametrize("options, plan_flags", [
    (None, ["--fsdp-version", 2]), (FSDP1, []),
    (BF16_FSDP2, ["--fsdp-version", 2, "--base-dtype", "bf16"]), (BF16_FSDP1, BF16_FSDP1[:2])],
    ids=["FSDP2", "FSDP1", "FSDP2 bf16 base", "FSDP1 bf16 base"])
def test_training_state_is_the_adapters_and_the_sharded_base(lora_reference, lora_run,
                                                             still_t5_dir, tmp_path, options,
                                                             plan_flags):
    """Measured after training, each rank holds half of the frozen base (in its dtype, without
    gradients or optimizer state) and the adapters with their gradients and AdamW's two moments
    (fp32): half of them under FSDP2, all of them under FSDP1 (which leaves them whole, see
    wrap_model), plus AdamW's 4-byte step per adapter tensor: to the byte
    (the tiny T5's sizes are even). --plan predicts the same from config.json alone."""
    run = lora_reference if options is None else lora_run(2, *options)
    base, adapters, tensors = adapters_and_base(still_t5_dir)
    base_bytes = 2 if "bf16" in (options or []) else 4
    fsdp2 = "--fsdp-version" in plan_flags
    expected = base * base_bytes // 2 + adapters * (4 + 4 + 8) // (2 if fsdp2 else 1) + 4 * tensors
    assert run.metrics["train_state_bytes"] == expected
    plan = plan_of(SCRIPT, tmp_path, "--model-name", still_t5_dir, "--world-size", 2,
                   "--lora-rank", 8, *plan_flags)
    assert plan["train_state_bytes"] == expected
    assert plan["trained_parameters"] == adapters
    if "bf16" in (options or []):  # computed in bf16: near the fp32 base's losses, but not the same
        fp32 = lora_reference.metrics["val_losses"]
        assert run.metrics["val_losses"] == pytest.approx(fp32, rel=1e-2)
        assert run.metrics["val_losses"] != pytest.approx(fp32, rel=1e-6)
        assert run.metrics["val_losses"][1] < run.metrics["val_losses"][0]
        assert "the base is frozen, in bfloat16" in run.stdout


def tensor_bytes(checkpoint):
    """The bytes of the tensors a DCP checkpoint holds, read from its metadata (its files add a
    header per tensor, which outweighs the tiny model's adapters)."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(checkpoint)).read_metadata().state_dict_metadata
    return sum(math.prod(m.size) * m.properties.dtype.itemsize for m in metadata.values()
               if hasattr(m, "size"))


def test_resumable_checkpoints_hold_the_adapters_alone(lora_reference, t5_reference, torchrun,
                                                       still_t5_dir, wikihow_dir, tmp_path):
    """The epoch-1 checkpoint holds the adapters and their AdamW state, not the frozen base (nor
    its tied embedding under other names): to the byte, 0.13 of a full fine-tuning checkpoint of
    the same model (the rank-8 adapters of this tiny T5 are an eighth of its size). Resumed on one
    process by FSDP1, epoch 2 gives the uninterrupted 2-rank FSDP2 run's losses within 1e-5."""
    checkpoint = lora_reference.cwd / "checkpoint-epoch-1"
    tensors = full_state_of(checkpoint)
    assert tensors and all("lora_" in name for name in tensors), sorted(tensors)
    _, adapters, adapter_tensors = adapters_and_base(still_t5_dir)
    size = tensor_bytes(checkpoint)
    assert size == 3 * 4 * adapters + 4 * adapter_tensors  # weights, 2 moments, steps (fp32)
    assert size < 0.14 * tensor_bytes(t5_reference.cwd / "checkpoint-epoch-1")
    with open(checkpoint / "trainer_state.json") as f:
        saved = json.load(f)
    assert saved["lora"] == {"rank": 8, "alpha": 16.0, "dropout": 0.0, "targets": ["q", "v"],
                             "base_dtype": "fp32"} and isinstance(saved["base"], float)
    shutil.copytree(checkpoint, tmp_path / "ckpt" / "checkpoint-epoch-1")
    run = torchrun(SCRIPT, *lora_args(still_t5_dir, wikihow_dir, 1, "--checkpoint-type",
                                      "sharded"), "--resume", "auto", "--save-dir", "ckpt",
                   nproc=1)
    assert run.returncode == 0, run.output
    assert "(epoch 1 done)" in run.stdout and warning_lines(run.output) == []
    for key in ("train_losses", "val_losses"):
        assert run.metrics[key] == pytest.approx(lora_reference.metrics[key], rel=1e-5)
