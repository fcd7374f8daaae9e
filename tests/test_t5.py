"""t5_fsdp_finetune.py and summarization_dataset.py on CPU (gloo): the offline WikiHow fixture and
a tiny T5."""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    NO_NETWORK,
    REPO,
    SMOKE,
    T5_REFERENCE,
    T5_SHARDED,
    T5_TINY,
    greedy_summaries,
    plan_of,
    run_command,
    single_error_line,
    start_torchrun,
    t5_args,
    torchrun_command,
    validation_loss,
    warning_lines,
)
from conftest import T5_INPUT_LENGTH as INPUT_LENGTH
from conftest import T5_OUTPUT_LENGTH as OUTPUT_LENGTH
from conftest import T5_VAL_SAMPLES as VAL_SAMPLES
from tiny_wikihow import (
    DROPPED,
    TEST,
    TRAIN,
    VAL,
    split_titles,
    write_csv_without_headline,
    write_wikihow,
)
from transformers import T5ForConditionalGeneration, T5Tokenizer

sys.path.insert(0, str(REPO))
from summarization_dataset import (  # noqa: E402
    WikiHowError,
    fallback_split,
    read_articles,
    rouge_scores,
    wikihow,
)

SCRIPT = "t5_fsdp_finetune.py"


@pytest.fixture
def t5_run(cached_torchrun, wikihow_dir, tiny_t5_dir):
    """A training run on 2 ranks with the tiny model; cached, so several tests read one run."""

    def run(*args, epochs=2):
        result = cached_torchrun(SCRIPT, *t5_args(tiny_t5_dir, wikihow_dir, epochs, *args))
        assert result.returncode == 0, result.output
        return result

    return run


@pytest.fixture(scope="session")
def tokenizer(tiny_t5_dir):
    return T5Tokenizer.from_pretrained(tiny_t5_dir)


@SMOKE("t5_fsdp_finetune.py")
def test_validation_loss_falls_every_epoch(t5_reference):
    run = t5_reference
    assert warning_lines(run.output) == []
    metrics = run.metrics
    assert (metrics["world_size"] == 2 and metrics["device"] == "cpu"
            and metrics["backend"] == "gloo")
    assert metrics["mixed_precision"] == "fp32"  # what auto picks on CPU
    val = metrics["val_losses"]
    assert len(val) == 3 and val[0] > val[1] > val[2], val
    assert metrics["val_loss"] == val[2] and metrics["train_losses"][2] < metrics["train_losses"][0]
    for epoch, (train_loss, val_loss) in enumerate(zip(metrics["train_losses"], val), 1):
        assert f"Train Epoch: \t{epoch}, Loss: \t{train_loss:.4f}" in run.stdout
        assert f"Validation Loss: {val_loss:.4f}" in run.stdout
    assert metrics["samples_per_s"] > 0 and len(metrics["epoch_times"]) == 3


def test_progress_bars_in_a_pipe_are_one_line_each(t5_reference):
    """Written to a pipe (the tests capture output so), rank 0's progress bars carry no colour codes
    and are not redrawn: each is one line, its final state. (The pipe's carriage returns would read
    here as line breaks, so a redrawn bar shows as several lines.)"""
    run = t5_reference
    assert "\x1b[" not in run.output
    bars = [re.sub(r" \[.*", "", line) for line in run.output.splitlines() if "%|" in line]
    assert bars == [bar for epoch in (1, 2, 3) for bar in (
        f"r0 Training Epoch {epoch}: 100%|##########| 8/8",
        "Validation Epoch: 100%|##########| 4/4")], bars


def evaluate_export(hf_dir, pt_file, plain_dir, data_dir, samples, input_length, output_length):
    """In the test's process, as a user's plain Python (no torchrun, no FSDP): the HF directory
    opened with from_pretrained, its validation loss, its greedy summaries and their ROUGE; and
    whether the .pt (where written), loaded into the untrained plain_dir's model, holds the same
    weights."""
    tokenizer = T5Tokenizer.from_pretrained(hf_dir)
    model = T5ForConditionalGeneration.from_pretrained(hf_dir).eval()
    same = None  # FSDP2 writes no .pt (without --full-state-dict)
    if pt_file is not None:
        plain = T5ForConditionalGeneration.from_pretrained(plain_dir)  # untrained: the .pt loads in
        plain.load_state_dict(torch.load(pt_file, weights_only=True))
        pairs = zip(plain.state_dict().values(), model.state_dict().values())
        same = all(torch.equal(p, q) for p, q in pairs)
    val = wikihow(tokenizer, "validation", samples, input_length, output_length, data_dir=data_dir)
    summaries = greedy_summaries(model, tokenizer, val, max_new_tokens=output_length)
    return {"val_loss": validation_loss(model, val), "same": same, "summaries": summaries,
            "rouge": rouge_scores(summaries, val.references(tokenizer))}


def check_export(run, tiny_t5_dir, wikihow_dir):
    """The run's best model, as .pt (where written) and as HF directory: they hold the same
    weights, the directory loads with from_pretrained and generates text, and it gives the logged
    validation loss. With --rouge, it writes token for token the summaries that the run generated
    on its ranks in that epoch (predictions file), and rouge_score gives them the run's ROUGE."""
    hf_dir, pt_file = run.metrics["checkpoint"], run.metrics["checkpoint_pt"]
    result = evaluate_export(hf_dir, pt_file, tiny_t5_dir, wikihow_dir, VAL_SAMPLES,
                             INPUT_LENGTH, OUTPUT_LENGTH)
    assert result["same"] is not False, "the .pt and the HF directory hold different weights"
    assert (result["same"] is None) == (pt_file is None)
    assert all(summary.strip() for summary in result["summaries"][:2]), result["summaries"]
    assert result["val_loss"] == pytest.approx(run.metrics["val_loss"], abs=1e-3)
    epoch = int(hf_dir.rsplit("/", 1)[1].split("-")[-3])  # T5-model-<date>-<epoch>-<loss>-hf
    generated = {scores["epoch"]: scores for scores in run.metrics["rouge_per_epoch"]}
    if generated:  # --rouge
        with open(generated[epoch]["predictions"], encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        assert result["summaries"] == [row["generated"] for row in rows]
        assert result["rouge"] == {key: generated[epoch][key] for key in result["rouge"]}


@SMOKE("t5_fsdp_finetune.py")
def test_best_model_loads_in_plain_python(t5_reference, tiny_t5_dir, wikihow_dir):
    """The HF directory loads with from_pretrained, generates text, and gives the logged best
    validation loss."""
    run = t5_reference
    hf_dir, pt_file = run.metrics["checkpoint"], run.metrics["checkpoint_pt"]
    assert (hf_dir.endswith("-3-%.4f-hf" % run.metrics["val_loss"])
            and pt_file == hf_dir[: -len("-hf")] + ".pt")
    assert len(list(run.cwd.glob("T5-model-*.pt"))) == 3  # saved at every improvement
    assert not list(run.cwd.glob("*.tmp"))
    check_export(run, tiny_t5_dir, wikihow_dir)


@SMOKE("t5_fsdp_finetune.py")
def test_resume_from_a_sharded_checkpoint_continues_exactly(t5_reference, torchrun, tmp_path,
                                                             tiny_t5_dir, wikihow_dir):
    """--resume auto from the reference's epoch-2 checkpoint trains epoch 3 as the uninterrupted
    run did: the same losses, bit for bit (dropout is reseeded per epoch)."""
    epoch_2 = shutil.copytree(t5_reference.cwd / "checkpoint-epoch-2",
                              tmp_path / "ckpt" / "checkpoint-epoch-2")
    run = torchrun(SCRIPT, *t5_args(tiny_t5_dir, wikihow_dir, 3, *T5_SHARDED), "--resume",
                   "auto", "--save-dir", "ckpt")
    assert run.returncode == 0, run.output
    assert re.search(rf"Resumed from \S*{epoch_2.relative_to(tmp_path)} \(epoch 2 done\)",
                     run.stdout), run.stdout
    assert run.metrics["train_losses"] == t5_reference.metrics["train_losses"]
    assert run.metrics["val_losses"] == t5_reference.metrics["val_losses"]


def test_a_resume_on_one_process_prints_no_warning(t5_reference, torchrun, tiny_t5_dir,
                                                   wikihow_dir):
    """The 2-rank epoch-2 checkpoint resumed by one process, under NO_SHARD: loading a sharded
    state dict there makes FSDP1 warn that it returns a full one, which the script filters. The
    checkpoints' paths are printed absolute, as every other path."""
    epoch_2 = t5_reference.cwd / "checkpoint-epoch-2"
    assert f"Saved sharded checkpoint {t5_reference.cwd / 'checkpoint-epoch-1'}" in (
        t5_reference.stdout.splitlines())
    run = torchrun(SCRIPT, *t5_args(tiny_t5_dir, wikihow_dir, 3), "--resume", epoch_2,
                   "--no-save-model", nproc=1)
    assert run.returncode == 0, run.output
    assert f"Resumed from {epoch_2} (epoch 2 done)" in run.stdout.splitlines()
    assert warning_lines(run.output) == []


def test_what_a_run_would_write_over_is_refused_before_the_model_loads(
        t5_reference, fsdp2_reference, tiny_t5_dir, wikihow_dir, tmp_path, help_text):
    """--save-dir and --resume are checked from their files alone, before any process starts or a
    model is loaded: each refusal is one line within 5 s of a 2-rank run, with no warning or leak
    report, and writes nothing. (They came after loading and wrapping the model, ending with the
    resource tracker's leaked-semaphore warning.) The timed runs start from the script's worker
    server as the others do, so it is started first (by --help)."""
    help_text(SCRIPT)
    earlier_run = tmp_path / "earlier_run"
    shutil.copytree(t5_reference.cwd / "checkpoint-epoch-1", earlier_run / "checkpoint-epoch-1")
    epoch_2 = t5_reference.cwd / "checkpoint-epoch-2"
    cases = [  # the options, and what the line says
        (["--checkpoint-type", "sharded", "--save-dir", earlier_run],
         [f"--save-dir {earlier_run} holds checkpoints of an earlier run",
          "add --resume auto", "--overwrite"]),
        (["--resume", fsdp2_reference.cwd / "ckpt" / "step_000010"],  # another script's
         ["step_000010: no complete checkpoint of this script in it", "trainer_state.json"]),
        (["--resume", epoch_2],
         [f"the checkpoint {epoch_2} has finished epoch 2 of --epochs 2", "raise --epochs"]),
    ]
    for options, expected in cases:
        before = sorted(tmp_path.rglob("*"))
        start = time.monotonic()
        run = run_command([sys.executable, REPO / SCRIPT, *t5_args(tiny_t5_dir, wikihow_dir, 2),
                           "--save-dir", tmp_path / "out", *options], tmp_path, timeout=60)
        assert run.returncode == 1 and time.monotonic() - start < 5, run.output
        line = single_error_line(run)
        assert all(e in line for e in expected), line
        assert warning_lines(run.output) == [] and "FSDP built" not in run.stdout, run.output
        assert sorted(tmp_path.rglob("*")) == before


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_cpu_ram_efficient_loading_trains_the_same(t5_reference, t5_run, tiny_t5_dir, wikihow_dir,
                                                   strategy):
    """Only rank 0 loads the weights; rank 1 builds the model on the meta device and receives them
    through sync_module_states. The same epoch losses as when every rank loads them, and the
    shared embedding stays tied: the exported model gives the logged validation loss. (The
    SHARD_GRAD_OP run also validates in batches of 3: the validation loss does not change.)"""
    options = ["--cpu-ram-efficient-loading", "--sharding-strategy", strategy,
               "--mixed-precision", "fp32"]
    if strategy == "SHARD_GRAD_OP":
        options += ["--test-batch-size", 3, "--no-save-model"]
    run = t5_run(*options)
    for key in ("train_losses", "val_losses"):
        assert run.metrics[key] == pytest.approx(t5_reference.metrics[key][:2], rel=1e-6)
    if strategy == "FULL_SHARD":
        check_export(run, tiny_t5_dir, wikihow_dir)
    else:  # 31 examples over 2 ranks: 16 each, in 6 batches of 3 instead of 4 of 4
        assert (run.metrics["val_batches"], t5_reference.metrics["val_batches"]) == (6, 4)


def test_cpu_ram_efficient_loading_lowers_the_memory_of_other_ranks(cached_torchrun, wide_t5_dir,
                                                                    wikihow_dir):
    """With a 322 MB model, rank 1's peak memory once the model is loaded and wrapped is lower when
    only rank 0 loads the weights; rank 0 loads them either way."""
    args = ["--model-name", wide_t5_dir, "--data-dir", wikihow_dir, "--input-length", 32,
            "--output-length", 16, "--num-train-samples", 4, "--num-val-samples", 4, "--epochs", 1,
            "--batch-size", 2, "--no-save-model", "--no-run-validation"]
    peaks = {}
    for options in ([], ["--cpu-ram-efficient-loading"]):
        run = cached_torchrun(SCRIPT, *args, *options)
        assert run.returncode == 0, run.output
        peaks[bool(options)] = run.metrics["peak_memory_after_loading_per_rank"]
    model_bytes = (wide_t5_dir / "model.safetensors").stat().st_size
    print(f"peak memory after loading per rank (MiB), every rank loads: "
          f"{[p / 2**20 for p in peaks[False]]}; rank 0 only: {[p / 2**20 for p in peaks[True]]}")
    assert peaks[True][1] < peaks[False][1] - 0.4 * model_bytes, (peaks, model_bytes)


def test_seed_and_batch_sizes_take_effect(t5_reference, t5_run):
    """Another --seed gives other losses (the same seed the same: the spawn test; this run also
    serves the HYBRID_SHARD warning test); --batch-size 2 makes twice the steps of the default 4,
    which the progress bar and the metrics report."""
    reference = t5_reference.metrics
    seed_2 = t5_run(*STRATEGY_RUNS["HYBRID_SHARD"][1], epochs=1).metrics
    assert seed_2["train_losses"][0] != pytest.approx(reference["train_losses"][0], rel=1e-4)
    batch_2 = t5_run("--batch-size", 2, "--no-save-model", epochs=1)
    assert (batch_2.metrics["train_batches"], reference["train_batches"]) == (16, 8)
    assert re.search(r"r0 Training Epoch 1: .*?\| \d+/16 \[", batch_2.stderr), batch_2.stderr


# What FSDP built, as the script reads it from the wrapped model: the reference run's defaults, and
# the options of each fp32 parity run. 5 units: the root and 2 encoder + 2 decoder T5Blocks.
REFERENCE_BUILT = ("FSDP built 5 units: FULL_SHARD, backward prefetch BACKWARD_PRE, CPU offload "
                   "False, use_orig_params False, limit_all_gathers True, mixed precision param "
                   "None reduce None buffer None (None: not cast), activation checkpointing of 0 "
                   "blocks")
OPTIONS_BUILT = {
    ("--sharding-strategy SHARD_GRAD_OP --backward-prefetch BACKWARD_POST "
     "--activation-checkpointing"):
        "SHARD_GRAD_OP, backward prefetch BACKWARD_POST, CPU offload False, use_orig_params "
        "False, limit_all_gathers True, mixed precision param None reduce None buffer None (None: "
        "not cast), activation checkpointing of 4 blocks",
    "--sharding-strategy NO_SHARD --backward-prefetch NONE --no-limit-all-gathers":
        "NO_SHARD, backward prefetch NONE, CPU offload False, use_orig_params False, "
        "limit_all_gathers False, mixed precision param None reduce None buffer None (None: not "
        "cast), activation checkpointing of 0 blocks",
}


# A run of each --sharding-strategy: (epochs, options). Each is a run that another test reads too
# (cached_torchrun launches it once): the reference, the fp32 option runs, and the seed test's,
# which uses HYBRID_SHARD (on one node of 2 processes it shards like FULL_SHARD, on a 1 x 2 mesh).
STRATEGY_RUNS = {
    "FULL_SHARD": (3, T5_REFERENCE),
    **{options.split()[1]: (2, [*options.split(), "--mixed-precision", "fp32", "--no-save-model"])
       for options in OPTIONS_BUILT},
    "HYBRID_SHARD": (1, ["--seed", 2, "--sharding-strategy", "HYBRID_SHARD", "--no-save-model"]),
}


@pytest.mark.parametrize("strategy", list(STRATEGY_RUNS))
def test_no_strategy_prints_a_warning(t5_run, strategy):
    """No --sharding-strategy prints a Python warning (FSDP1 deprecates NO_SHARD with a
    FutureWarning per unit, which the script filters: the strategy works); world size 1, where
    NO_SHARD's state dicts warn too, is the one-process test's."""
    epochs, options = STRATEGY_RUNS[strategy]
    run = t5_run(*options, epochs=epochs)
    assert f"FSDP built 5 units: {strategy}," in run.stdout
    assert warning_lines(run.output) == []


@pytest.mark.parametrize("strategy", list(STRATEGY_RUNS))
def test_plan_predicts_the_training_state(t5_run, tiny_t5_dir, tmp_path, strategy):
    """--plan, which reads only config.json, gives each strategy's training state per rank
    (FSDP1's padded flat shards, their gradients and AdamW state) as measured, within 1%; and
    what --rouge's generation adds per rank: the whole model (gathered), or the units training
    gathers (by block). (benchmarks/README.md holds them against t5-base's shape.)"""
    epochs, options = STRATEGY_RUNS[strategy]
    measured = t5_run(*options, epochs=epochs).metrics["train_state_bytes"]
    plan = plan_of(SCRIPT, tmp_path, "--model-name", tiny_t5_dir, "--world-size", 2,
                   "--sharding-strategy", strategy)
    assert plan["train_state_bytes"] == pytest.approx(measured, rel=0.01)
    assert plan["generation_gathered_bytes"] == 4 * plan["parameters"]  # fp32
    assert plan["generation_by_block_bytes"] == plan["gathered_bytes"]


def saved_for_backward(model_dir, batch, input_length, output_length):
    """The bytes autograd keeps from forward to backward in one training step of the tiny T5,
    computed as the script does (one process, fp32, no FSDP: a rank's activations do not depend
    on sharding), counted with saved_tensors_hooks."""
    model = T5ForConditionalGeneration.from_pretrained(model_dir).train()  # dropout, as trained
    inputs, labels = (torch.randint(2, model.config.vocab_size, (batch, length))
                      for length in (input_length, output_length))
    saved = []

    def pack(tensor):
        saved.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        logits = model(input_ids=inputs, labels=labels, use_cache=False).logits
        loss = F.cross_entropy(logits.float().transpose(1, 2), labels)
    loss.backward()
    return sum(saved)


def test_plan_predicts_the_activations(tiny_t5_dir, tmp_path):
    """--plan's activations and logits buffers of a step: within 15% of the bytes autograd saves
    for backward."""
    batch = 4
    saved = saved_for_backward(tiny_t5_dir, batch, INPUT_LENGTH, OUTPUT_LENGTH)
    plan = plan_of(SCRIPT, tmp_path, "--model-name", tiny_t5_dir, "--world-size", 1,
                   "--batch-size", batch, *T5_TINY)
    predicted = plan["activation_bytes"] + plan["logits_bytes"]
    print(f"predicted {predicted:,} bytes, saved for backward {saved:,}")
    assert predicted == pytest.approx(saved, rel=0.15)


@pytest.mark.parametrize("options", list(OPTIONS_BUILT))
def test_fp32_options_give_the_same_losses(t5_reference, t5_run, options):
    """Same seed and data: sharding, prefetch, all-gather limits and activation checkpointing do not
    change the epoch losses; what FSDP built from them is read from the model and printed."""
    reference = t5_reference
    run = t5_run(*options.split(), "--mixed-precision", "fp32", "--no-save-model")
    assert REFERENCE_BUILT in reference.stdout.splitlines()
    assert f"FSDP built 5 units: {OPTIONS_BUILT[options]}" in run.stdout.splitlines()
    for key in ("train_losses", "val_losses"):
        assert run.metrics[key] == pytest.approx(reference.metrics[key][:2], rel=1e-4)


def test_full_shard_halves_training_state(t5_reference, t5_run):
    full = t5_reference.metrics["train_state_bytes"]
    replicated = t5_run("--sharding-strategy", "NO_SHARD", "--backward-prefetch", "NONE",
                        "--no-limit-all-gathers", "--mixed-precision", "fp32",
                        "--no-save-model").metrics["train_state_bytes"]
    assert full <= 0.55 * replicated, (full, replicated)


@pytest.mark.parametrize("version, precision", [
    (1, "bf16"), (1, "grad-bf16"), (1, "fp16"), (2, "bf16"), (2, "grad-bf16")])
def test_reduced_precision_learns(t5_reference, t5_run, cached_torchrun, wikihow_dir, tiny_t5_dir,
                                  version, precision):
    """bf16 and grad-bf16 run on CPU under either version; fp16 either runs or says in one line
    why it cannot. Each gives other losses than the same version's fp32 run, near them: the
    policy really computes (bf16) or reduces (grad-bf16) in bf16 (FSDP2's fp32 run: its
    --cpu-ram-efficient-loading run, the same weights). Without the policy in fully_shard, the
    FSDP2 runs would equal it."""
    fp32 = t5_reference.metrics["val_losses"][:2]
    if version == 2:
        fp32 = t5_run("--cpu-ram-efficient-loading", *V2).metrics["val_losses"]
    run = cached_torchrun(SCRIPT, *t5_args(tiny_t5_dir, wikihow_dir, 2, "--mixed-precision",
                                             precision, "--no-save-model", "--fsdp-version",
                                             version))
    if precision == "fp16" and run.returncode != 0:
        assert "fp16" in single_error_line(run)
        return
    assert run.returncode == 0, run.output
    assert run.metrics["mixed_precision"] == precision and warning_lines(run.output) == []
    val = run.metrics["val_losses"]
    assert val[1] < val[0] and val == pytest.approx(fp32, rel=0.05)
    assert val != pytest.approx(fp32, rel=1e-6)  # the policy really changed the arithmetic


def test_lr_and_gamma_drive_the_optimizer(t5_reference, t5_run):
    """--lr sets the first epoch's steps; --gamma 0 makes the learning rate 0 from epoch 2,
    freezing the model."""
    reference = t5_reference.metrics["val_losses"]
    val = t5_run("--lr", 0.005, "--gamma", 0, "--no-save-model",
                 "--no-track-memory").metrics["val_losses"]
    assert val[0] != pytest.approx(reference[0], rel=1e-4)
    assert val[1] == val[0]


def test_without_validation_the_last_epoch_is_saved(t5_reference, t5_run, wikihow_dir, tmp_path):
    """--no-run-validation evaluates nothing, needs no validation articles (here its list is
    empty) and saves the last epoch."""
    data = shutil.copytree(wikihow_dir, tmp_path / "no_validation_articles")
    (data / "all_val.txt").write_text("")
    run = t5_run("--no-run-validation", "--no-track-memory", "--data-dir", data)
    memory = "Peak memory per rank (process RSS): "
    # the final one only
    assert "Validation Loss" not in run.stdout and run.stdout.count(memory) == 1
    assert t5_reference.stdout.count(memory) == 4  # after each of the 3 epochs, and the final one
    assert run.metrics["val_losses"] == [None, None] and run.metrics["val_loss"] is None
    assert ([p.name for p in run.cwd.glob("T5-model-*.pt")]
            == [run.metrics["checkpoint_pt"].split("/")[-1]])
    assert (run.metrics["checkpoint"].endswith("-2-hf")
            and (run.cwd / run.metrics["checkpoint"]).is_dir())


def test_python_spawns_two_cpu_processes(t5_reference, tiny_t5_dir, wikihow_dir, tmp_path):
    """`python t5_fsdp_finetune.py --cpu ...` starts 2 CPU processes itself, without torchrun, and
    its first epoch is the torchrun reference run's."""
    command = [sys.executable, REPO / SCRIPT, *t5_args(tiny_t5_dir, wikihow_dir, 1), "--cpu",
               "--no-save-model"]
    run = run_command(command, tmp_path, timeout=300)
    assert run.returncode == 0, run.output
    assert warning_lines(run.output) == []
    assert run.metrics["world_size"] == 2 and run.metrics["device"] == "cpu"
    assert run.metrics["val_losses"] == pytest.approx(t5_reference.metrics["val_losses"][:1],
                                                      rel=1e-6)


def test_one_process_uses_no_shard_without_warnings(tmp_path, tiny_t5_dir, wikihow_dir):
    """At world size 1 there is nothing to shard: the script says so and picks NO_SHARD itself, so
    neither wrapping nor saving the model prints a warning. Its output goes to one file, as a batch
    job's log does: no carriage returns or colour codes, each progress bar one line, and no line
    starts on a bar's line (as `Train Epoch` did after a bar cleared with a carriage return)."""
    metrics_path, log = tmp_path / "metrics.json", tmp_path / "log.txt"
    command = torchrun_command(SCRIPT, [*t5_args(tiny_t5_dir, wikihow_dir, 1), "--metrics-json",
                                        metrics_path], 1)
    job = start_torchrun(command, tmp_path, dict(os.environ), outputs=(log, log))
    try:
        assert job.wait(300) == 0, log.read_text()
    finally:
        if job.poll() is None:  # timed out
            job.kill()
    output = log.read_bytes()
    assert b"\r" not in output and b"\x1b[" not in output
    lines = output.decode().splitlines()
    assert warning_lines("\n".join(lines)) == []
    assert "FULL_SHARD with one process: NO_SHARD" in lines
    bar = re.compile(r"r0 Training Epoch 1: 100%\|#+\| 16/16 \[.*\]")  # the whole line
    assert any(bar.fullmatch(line) for line in lines)
    assert any(line.startswith("Train Epoch: \t1, Loss: \t") for line in lines)
    assert any(line.startswith("FSDP built 5 units: NO_SHARD") for line in lines)
    metrics = json.loads(metrics_path.read_text())
    assert metrics["world_size"] == 1 and metrics["sharding_strategy"] == "NO_SHARD"
    assert (tmp_path / metrics["checkpoint"]).is_dir()


def test_no_cuda_is_the_tutorials_name_for_cpu(monkeypatch, tiny_t5_dir, wikihow_dir):
    """--no-cuda (the tutorial's and the MNIST scripts' flag) sets what --cpu sets."""
    from t5_fsdp_finetune import parse_args

    command = [SCRIPT, "--model-name", str(tiny_t5_dir), "--data-dir", str(wikihow_dir)]
    for flags, cpu in (([], False), (["--no-cuda"], True), (["--cpu"], True)):
        monkeypatch.setattr(sys, "argv", command + flags)
        assert parse_args().cpu is cpu, flags


def test_an_unreachable_hub_fails_in_one_line_at_once(tmp_path, wikihow_dir):
    """A hub id that is not in the cache, without network and without HF_HUB_OFFLINE: one line,
    before any process group starts, instead of the hub client's retries (30 s, 10 log lines).
    (With HF_HUB_OFFLINE: test_bad_input.py.)"""
    command = [sys.executable, REPO / SCRIPT, "--model-name", "fsdp-tests/no-such-t5",
               "--data-dir", wikihow_dir]
    start = time.monotonic()
    run = run_command(command, tmp_path, timeout=60, env={**NO_NETWORK, "HF_HUB_OFFLINE": "0"})
    assert run.returncode == 1 and time.monotonic() - start < 45, run.output
    assert "Retrying" not in run.output  # the hub client's "Retrying in 1s [Retry 1/5]"
    line = single_error_line(run)
    assert all(s in line for s in ("--model-name fsdp-tests/no-such-t5 is not a local directory",
                                   "https://huggingface.co cannot be reached")), line


def test_an_interrupted_run_says_where_a_rerun_resumes(tmp_path):
    """resume_hint, the line the plumbing prints on Ctrl-C or SIGTERM: the newest complete
    checkpoint of --save-dir, or that a rerun starts from epoch 1."""
    from argparse import Namespace

    from safeguards.t5_saves import resume_hint

    args = Namespace(save_model=True, checkpoint_type="sharded", save_dir=str(tmp_path))
    hint = resume_hint(args, "trainer_state.json")
    assert hint() == (f"no complete checkpoint in --save-dir {tmp_path} yet: a rerun starts from "
                      "epoch 1")
    for epoch in (1, 2):
        (tmp_path / f"checkpoint-epoch-{epoch}").mkdir()
        (tmp_path / f"checkpoint-epoch-{epoch}" / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-epoch-3.tmp").mkdir()
    assert hint() == (f"the last complete checkpoint is epoch 2 ({tmp_path}/checkpoint-epoch-2): "
                      "run the same command with --resume auto to resume")
    args.checkpoint_type = "full"
    assert resume_hint(args, "trainer_state.json") == (
        "no resumable checkpoints (--checkpoint-type full): a rerun starts from epoch 1")


def test_resume_picks_the_newest_complete_checkpoint(tmp_path):
    from safeguards.t5_saves import resume_target, t5_folder

    folder = t5_folder(str(tmp_path), "trainer_state.json")
    for name in ("checkpoint-epoch-2", "checkpoint-epoch-10", "checkpoint-epoch-11.tmp",
                 "checkpoint-epoch-12"):
        (tmp_path / name).mkdir()
        if name != "checkpoint-epoch-12":  # no trainer_state.json: incomplete
            (tmp_path / name / "trainer_state.json").write_text("{}")
    assert resume_target("auto", folder) == str(tmp_path / "checkpoint-epoch-10")
    assert resume_target(str(tmp_path), folder) == str(tmp_path / "checkpoint-epoch-10")
    assert (resume_target(str(tmp_path / "checkpoint-epoch-2"), folder)
            == str(tmp_path / "checkpoint-epoch-2"))
    assert resume_target(str(tmp_path / "checkpoint-epoch-12"), folder) is None


def test_the_fixture_command_prints_no_progress_bar(tmp_path):
    """`python tests/tiny_wikihow.py DATA MODEL` (the README's offline T5) writes both folders and
    says so in one line: no "Writing model shards" bar, whose carriage returns litter a log."""
    run = subprocess.run([sys.executable, REPO / "tests" / "tiny_wikihow.py", "data", "model"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert (run.stdout + run.stderr).strip().splitlines() == [
        "wrote data/wikihowAll.csv (+ split lists) and the tiny T5 model and tokenizer in model"]
    assert (tmp_path / "model" / "config.json").exists()


def test_help_explains_every_flag(help_text):
    flags = ["--model-name", "--data-dir", "--batch-size", "--test-batch-size", "--epochs", "--lr",
             "--gamma", "--seed", "--num-train-samples", "--num-val-samples", "--input-length",
             "--output-length", "--sharding-strategy", "--backward-prefetch", "--mixed-precision",
             "--activation-checkpointing", "--limit-all-gathers", "--track-memory",
             "--no-track-memory", "--run-validation", "--no-run-validation", "--save-model",
             "--no-save-model", "--checkpoint-type", "--resume", "--save-dir", "--overwrite",
             "--cpu", "--no-cuda", "--world-size", "--dist-timeout", "--metrics-json",
             "--cpu-ram-efficient-loading", "--fsdp-version", "--max-tokens"]
    text = help_text(SCRIPT)
    assert [f for f in flags if f not in text] == []
    assert ("(default: t5-base)" in text and "(default: 1500)" in text
            and "(default: 0.002)" in text)
    # FSDP1's flags say what each becomes under FSDP2 (README: 't5_fsdp_finetune.py on FSDP2')
    flat = " ".join(text.split())
    for mapped in ("FSDP2: reshard_after_forward=True", "SHARD_GRAD_OP keeps", "(ZeRO-2; False)",
                   "FSDP2: a 2-D mesh", "FSDP2: bf16 reduces in fp32, no fp16",
                   "FSDP2: every rank reads its shards", "FSDP2 limits its own, and refuses it"):
        assert mapped in flat, mapped


# The dataset, in this process.

def titles(dataset):
    return [title for title, _, _ in dataset.articles]


def test_split_files_are_honoured(tokenizer, wikihow_dir):
    expected = split_titles()
    for split, key in (("train", "train"), ("validation", "val"), ("val", "val"), ("test", "test")):
        dataset = wikihow(tokenizer, split, None, INPUT_LENGTH, OUTPUT_LENGTH, data_dir=wikihow_dir)
        assert titles(dataset) == [t for t in expected[key] if t not in DROPPED], split
    first = wikihow(tokenizer, "train", 5, INPUT_LENGTH, OUTPUT_LENGTH, data_dir=wikihow_dir)
    assert titles(first) == expected["train"][:5] and len(first) == 5


SPLITS_IN_A_FRESH_PROCESS = """
import json, sys
sys.path.insert(0, sys.argv[1])
from summarization_dataset import read_articles
splits = ("train", "validation", "test")
print(json.dumps({split: [t for t, _, _ in read_articles(sys.argv[2], split)] for split in splits}))
"""


def test_fallback_split_is_deterministic_and_disjoint(tmp_path):
    data = write_wikihow(tmp_path / "no_split_lists", split_files=False)
    splits = {split: [t for t, _, _ in read_articles(data, split)]
              for split in ("train", "validation", "test")}
    kept = [t for key in ("train", "val", "test") for t in split_titles()[key] if t not in DROPPED]
    # disjoint, and every article in one split
    assert sorted(sum(splits.values(), [])) == sorted(kept)
    assert len(splits["train"]) > 0.8 * len(kept) and splits["validation"] and splits["test"]
    assert all(fallback_split(t) == split for split, ts in splits.items() for t in ts)
    # Every rank computes the split itself: it must not depend on the process (e.g. on Python's
    # hash seed).
    proc = subprocess.run([sys.executable, "-c", SPLITS_IN_A_FRESH_PROCESS, REPO, data],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONHASHSEED": "12345"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == splits


def test_filtered_rows_are_dropped_and_text_cleaned(wikihow_dir):
    articles = [a for split in ("train", "validation", "test")
                for a in read_articles(wikihow_dir, split)]
    assert len(articles) == TRAIN + VAL + TEST  # every other article is kept
    assert not {t for t, _, _ in articles} & set(DROPPED)
    for _, text, headline in articles:
        assert ".," not in headline and headline.endswith(".")
        for junk in ("\n", "Example of text:", "``", '"', ".,", " ,", "  "):
            assert junk not in text and junk not in headline
    first = read_articles(wikihow_dir, "train", 1)[0]
    assert first[2] == "Use a sponge. Polish the guitar in small sections. Check it in daylight."


def test_label_padding_is_minus_100(tokenizer, wikihow_dir):
    dataset = wikihow(tokenizer, "validation", None, INPUT_LENGTH, OUTPUT_LENGTH,
                      data_dir=wikihow_dir)
    item = dataset[0]
    assert set(item) == {"source_ids", "source_mask", "target_ids", "target_mask"}
    mask, ids = dataset.target_mask, dataset.target_ids
    assert (ids.shape == (len(dataset), OUTPUT_LENGTH)
            and dataset.source_ids.shape == (len(dataset), INPUT_LENGTH))
    # some summaries padded, some truncated
    assert (mask == 0).any() and (mask == 1).all(dim=1).any()
    assert torch.equal(ids == -100, mask == 0)
    assert (dataset.source_ids[dataset.source_mask == 0] == tokenizer.pad_token_id).all()


def incomplete_split_lists(tmp_path):
    data = write_wikihow(tmp_path / "incomplete")
    (data / "all_test.txt").unlink()
    return data


@pytest.mark.parametrize("make, message", [
    (lambda tmp_path: tmp_path, ["wikihowAll.csv not found", "ucsb.box.com", "README.md, 'Data'"]),
    (write_csv_without_headline, ["lacks the column(s) headline", "headline, title, text"]),
    (incomplete_split_lists, ["all_val.txt but not all of", "all_test.txt"]),
], ids=["missing csv", "missing columns", "incomplete split lists"])
def test_dataset_errors_say_what_to_do(tokenizer, tmp_path, make, message):
    with pytest.raises(WikiHowError) as error:
        wikihow(tokenizer, "train", None, INPUT_LENGTH, OUTPUT_LENGTH, data_dir=make(tmp_path))
    assert all(m in str(error.value) for m in message) and "\n" not in str(error.value), error.value


@pytest.mark.gpu
def test_reduced_precision_on_one_gpu(torchrun, wikihow_dir, tiny_t5_dir):
    """World size 1 on a GPU: auto picks bf16 where the GPU has it; fp16 with the sharded grad
    scaler learns."""
    for precision in ("auto", "fp16"):
        run = torchrun(SCRIPT, *t5_args(tiny_t5_dir, wikihow_dir, 2, "--mixed-precision", precision,
                                          "--no-save-model"), nproc=1)
        assert run.returncode == 0, run.output
        assert run.metrics["device"] == "cuda" and run.metrics["backend"] == "nccl"
        expected = "fp16"
        if precision == "auto":
            expected = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp32"
        assert run.metrics["mixed_precision"] == expected
        assert run.metrics["val_losses"][1] < run.metrics["val_losses"][0]
        assert "Peak memory per rank (CUDA allocated)" in run.stdout


# --fsdp-version 2: FSDP2's fully_shard on the same model, with FSDP1's losses and checkpoints.
V2 = ["--fsdp-version", 2]


def fsdp2_built(run, reshard, checkpointed=0):
    """Whether the run printed FSDP2's groups as built: 5 groups, fp32, the blocks resharded after
    forward (reshard) or not, checkpointed of the 4 blocks recomputed in backward."""
    lines = run.stdout.splitlines()
    return ("FSDP2 sharded 5 groups on a (2,) mesh: mixed precision param None reduce None (None: "
            "not cast)" in lines and "Blocks compiled: 0 of 4 (torch.compile, in place); "
            f"activation checkpointing: {checkpointed} of 4" in lines
            and any(line.startswith("  FSDP unit encoder.block.0: ") and
                    f"reshard after forward {reshard}," in line for line in lines))


# The equality runs use the script's default --lr 0.002: at T5_TINY's 0.01, Adam grows the last
# digits' differences between FSDP1's flat-parameter kernels and FSDP2's to 1.2e-5 by epoch 3. At
# that rate they train on 128 articles, not T5_TINY's 64: with 24 steps, one of the exported
# model's first two summaries was still empty (check_export).
AT_THE_DEFAULT_LR = ["--lr", 0.002, "--num-train-samples", 128]


def strategy_run(t5_run, strategy, version):
    """FULL_SHARD: the reference's sharded checkpoints for 3 epochs (FSDP2's run also generates its
    summaries block by block: 4 batches a rank, each a generate() whose encoder runs outside the
    root's hooks); SHARD_GRAD_OP: FSDP1's run of STRATEGY_RUNS without the BACKWARD_POST prefetch
    that FSDP2 refuses (it changes no loss), for 2. Both at the default lr, under --fsdp-version
    `version`."""
    if strategy == "FULL_SHARD":
        by_block = ["--rouge", "--generate", "by-block"] if version == 2 else []
        return t5_run(*T5_SHARDED, *AT_THE_DEFAULT_LR, "--fsdp-version", version, *by_block,
                      epochs=3)
    options = STRATEGY_RUNS["SHARD_GRAD_OP"][1]
    return t5_run(*[o for o in options if o not in ("--backward-prefetch", "BACKWARD_POST")],
                  *AT_THE_DEFAULT_LR, "--fsdp-version", version, epochs=2)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_fsdp2_plan_predicts_the_training_state(t5_run, tiny_t5_dir, tmp_path, strategy):
    """--plan --fsdp-version 2: FSDP2's shards (each parameter's rows over the ranks), their
    gradients and AdamW state (a step per parameter) as measured, exactly."""
    measured = strategy_run(t5_run, strategy, version=2).metrics["train_state_bytes"]
    plan = plan_of(SCRIPT, tmp_path, "--model-name", tiny_t5_dir, "--world-size", 2,
                   "--sharding-strategy", strategy, *V2)
    assert plan["train_state_bytes"] == measured


@SMOKE("t5_fsdp_finetune.py")
def test_fsdp2_trains_exactly_as_fsdp1(t5_run, tiny_t5_dir, wikihow_dir):
    """FULL_SHARD (reshard_after_forward=True), fp32, the same seed: every epoch's train and
    validation loss of FSDP1's run within 1e-5, no warning; its best model exports as FSDP1's does
    (the .pt and the HF directory hold the same weights, which give the logged loss)."""
    fsdp1, run = (strategy_run(t5_run, "FULL_SHARD", version) for version in (1, 2))
    assert fsdp2_built(run, True), run.stdout
    assert warning_lines(run.output) == []
    for key in ("train_losses", "val_losses"):
        assert run.metrics[key] == pytest.approx(fsdp1.metrics[key], rel=1e-5)
    assert (run.metrics["fsdp_version"], fsdp1.metrics["fsdp_version"]) == (2, 1)
    check_export(run, tiny_t5_dir, wikihow_dir)


def test_fsdp2_shard_grad_op_keeps_the_parameters_to_backward(t5_run):
    """SHARD_GRAD_OP is reshard_after_forward=False, read from the sharded model; with activation
    checkpointing, the losses of FSDP1's SHARD_GRAD_OP run within 1e-5."""
    fsdp1, run = (strategy_run(t5_run, "SHARD_GRAD_OP", version) for version in (1, 2))
    assert fsdp2_built(run, False, checkpointed=4), run.stdout
    assert warning_lines(run.output) == []
    for key in ("train_losses", "val_losses"):
        assert run.metrics[key] == pytest.approx(fsdp1.metrics[key], rel=1e-5)


@pytest.mark.parametrize("version", [1, 2])
def test_sharded_checkpoints_cross_between_fsdp_versions(t5_run, torchrun, tmp_path, tiny_t5_dir,
                                                          wikihow_dir, version):
    """The other version's epoch-2 checkpoint (DCP, the same parameter names) resumes under this
    one and trains epoch 3 as the run that wrote it did."""
    writer = strategy_run(t5_run, "FULL_SHARD", version=3 - version)
    shutil.copytree(writer.cwd / "checkpoint-epoch-2", tmp_path / "ckpt" / "checkpoint-epoch-2")
    run = torchrun(SCRIPT, *t5_args(tiny_t5_dir, wikihow_dir, 3, *T5_SHARDED, *AT_THE_DEFAULT_LR),
                   "--fsdp-version", version, "--resume", "auto", "--save-dir", "ckpt")
    assert run.returncode == 0, run.output
    assert "(epoch 2 done)" in run.stdout and run.metrics["fsdp_version"] == version
    for key in ("train_losses", "val_losses"):
        assert run.metrics[key] == pytest.approx(writer.metrics[key], rel=1e-5)


def test_fsdp2_cpu_ram_efficient_loading_trains_the_same(t5_reference, t5_run, tiny_t5_dir,
                                                         wikihow_dir):
    """Rank 0 loads the weights, rank 1 builds on the meta device; after sharding, rank 1 gets its
    shards from rank 0 (set_model_state_dict, broadcast_from_rank0). FSDP1's losses, and the shared
    embedding stays tied: the export gives the logged validation loss."""
    run = t5_run("--cpu-ram-efficient-loading", *V2)
    for key in ("train_losses", "val_losses"):
        assert run.metrics[key] == pytest.approx(t5_reference.metrics[key][:2], rel=1e-5)
    check_export(run, tiny_t5_dir, wikihow_dir)


@pytest.mark.parametrize("version", [1, 2])
def test_an_untied_lm_head_trains_and_exports(cached_torchrun, untied_t5_dir, wikihow_dir, version):
    """A T5 whose lm_head is its own (T5 v1.1, flan-t5) trains under both versions with the same
    losses, also when only rank 0 loads it (--cpu-ram-efficient-loading: the meta-device rank,
    which transformers builds tied, unties as rank 0's is), and its HF export keeps that lm_head
    (tying it to the embedding would lose it)."""
    runs = [cached_torchrun(SCRIPT, *t5_args(untied_t5_dir, wikihow_dir, 1), "--fsdp-version", v,
                            *loading)
            for v, loading in ((1, []), (version, ["--cpu-ram-efficient-loading"]))]
    assert all(run.returncode == 0 for run in runs), runs[-1].output
    run = runs[-1]
    for key in ("train_losses", "val_losses"):
        assert run.metrics[key] == pytest.approx(runs[0].metrics[key], rel=1e-5)
    # FSDP1: equal to its own .pt; FSDP2 writes none: close to FSDP1's (the same training, above)
    exported = T5ForConditionalGeneration.from_pretrained(run.metrics["checkpoint"])
    own = run.metrics["checkpoint_pt"]
    full = torch.load(own or runs[0].metrics["checkpoint_pt"], weights_only=True)
    assert exported.lm_head.weight is not exported.shared.weight
    torch.testing.assert_close(exported.lm_head.weight, full["lm_head.weight"], rtol=0,
                               atol=0 if own else 1e-6)


def still_args(still_t5_dir, wikihow_dir, ranks, *args):
    """2 epochs of the dropout-free tiny T5 in a global batch of 8 over `ranks` ranks. (At --lr
    0.01, Adam makes the last digits' differences of another reduction order grow to 1e-5 in 32
    steps; at 0.002 they stay below 1e-7.)"""
    return [*t5_args(still_t5_dir, wikihow_dir, 2), "--lr", 0.002, "--batch-size", 8 // ranks,
            *args]


@pytest.mark.parametrize("ranks", [1, 2])
def test_fsdp2_at_other_world_sizes_gives_the_same_losses(cached_torchrun, still_t5_dir,
                                                          wikihow_dir, ranks):
    """Without dropout and with the same global batch, FSDP2 on 1 and on 2 ranks gives FSDP1's
    2-rank losses within 1e-5 (HSDP on 2 x 2: tests/test_two_nodes.py)."""
    fsdp1 = cached_torchrun(SCRIPT, *still_args(still_t5_dir, wikihow_dir, 2, *T5_SHARDED))
    run = cached_torchrun(SCRIPT, *still_args(still_t5_dir, wikihow_dir, ranks, *V2,
                                              "--no-save-model"), nproc=ranks)
    assert fsdp1.returncode == 0 and run.returncode == 0, fsdp1.output + run.output
    for key in ("train_losses", "val_losses"):
        assert run.metrics[key] == pytest.approx(fsdp1.metrics[key], rel=1e-5)


def test_fsdp1_checkpoint_resumes_under_fsdp2_on_one_rank(cached_torchrun, torchrun, tmp_path,
                                                          still_t5_dir, wikihow_dir):
    """FSDP1's 2-rank epoch-1 checkpoint resumed by FSDP2 on 1 rank (DCP reshards it) trains epoch 2
    as the 2-rank run did, within 1e-5."""
    fsdp1 = cached_torchrun(SCRIPT, *still_args(still_t5_dir, wikihow_dir, 2, *T5_SHARDED))
    shutil.copytree(fsdp1.cwd / "checkpoint-epoch-1", tmp_path / "ckpt" / "checkpoint-epoch-1")
    run = torchrun(SCRIPT, *still_args(still_t5_dir, wikihow_dir, 1, *T5_SHARDED, *V2),
                   "--resume", "auto", "--save-dir", "ckpt", nproc=1)
    assert run.returncode == 0, run.output
    for key in ("train_losses", "val_losses"):
        assert run.metrics[key] == pytest.approx(fsdp1.metrics[key], rel=1e-5)


@pytest.mark.gpu
def test_fsdp2_on_one_gpu(torchrun, wikihow_dir, tiny_t5_dir):
    """World size 1 on a GPU under FSDP2: auto's bf16 (computed in bf16, reduced in fp32) learns,
    with the weights broadcast from rank 0 and a sharded checkpoint per epoch; the export opens."""
    run = torchrun(SCRIPT, *t5_args(tiny_t5_dir, wikihow_dir, 2, *V2, "--checkpoint-type",
                                    "sharded", "--cpu-ram-efficient-loading"), nproc=1)
    assert run.returncode == 0, run.output
    assert run.metrics["device"] == "cuda" and run.metrics["fsdp_version"] == 2
    if torch.cuda.is_bf16_supported(including_emulation=False):
        assert run.metrics["mixed_precision"] == "bf16"
    assert run.metrics["val_losses"][1] < run.metrics["val_losses"][0]
    assert warning_lines(run.output) == []


@pytest.mark.gpu
def test_fsdp2_compiled_on_one_gpu(torchrun, wikihow_dir, still_t5_dir):
    """--compile on a GPU (Triton kernels), bf16, full fine-tuning of the dropout-free T5: each
    epoch's train and validation loss within 1e-2 of eager's (bf16 rounds where the kernels fuse),
    every graph compiled in epoch 1 and none after, the summaries generated eagerly (--rouge,
    block by block: the compiled blocks would compile for every length the cache grows to)."""
    runs = [torchrun(SCRIPT, *t5_args(still_t5_dir, wikihow_dir, 3, *V2, "--no-save-model",
                                      "--rouge", "--generate", "by-block", *compile), nproc=1)
            for compile in ([], ["--compile"])]
    for run in runs:
        assert run.returncode == 0, run.output
        assert run.metrics["device"] == "cuda" and warning_lines(run.output) == []
    eager, compiled = (run.metrics for run in runs)
    graphs = compiled["compiled_graphs_per_epoch"]
    assert graphs[0] > 0 and graphs[1:] == [0, 0], graphs
    for key in ("train_losses", "val_losses"):
        assert compiled[key] == pytest.approx(eager[key], rel=1e-2), key
