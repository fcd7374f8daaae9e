"""fsdp2_transformer.py, run for real on CPU (gloo): learning, parity, initialization, resume,
memory, errors."""
import json
import math
import re
import statistics
import sys
import time

import pytest
import torch
from conftest import FSDP2_TINY as TINY
from conftest import (
    REPO,
    SMOKE,
    copy_fsdp2_checkpoint,
    distributed_program,
    run_command,
    script_with_lines,
    single_error_line,
    torchrun_command,
    warning_lines,
)

sys.path.insert(0, str(REPO))
from fsdp2_transformer import Transformer, global_batch, task_rules  # noqa: E402

SCRIPT = "fsdp2_transformer.py"
CONFIG = {"vocab_size": 64, "dim": 32, "n_layers": 3, "n_heads": 4, "seq_len": 16}  # TINY's sizes


@pytest.fixture
def fsdp2_run(cached_torchrun):
    """A run that must succeed. Cached: several tests read the same run."""

    def run(*args, nproc=2):
        result = cached_torchrun(SCRIPT, *args, nproc=nproc)
        assert result.returncode == 0, result.output
        return result

    return run


def load_files(folder):
    return (torch.load(folder / "model.pt", weights_only=True),
            torch.load(folder / "optimizer.pt", weights_only=True))


def plan(run):
    """{FSDP unit: (reshard after forward, forward prefetch, backward prefetch)}, as the script read
    them from the sharded model and printed them."""
    units = re.findall(r"FSDP unit (\S+): [\d,]+ parameters, reshard after forward (\w+), explicit "
                       r"prefetch: forward (\[.*?\]), backward (\[.*?\])", run.stdout)
    return {unit: tuple(rest) for unit, *rest in units}


def test_default_command_learns_the_task(tmp_path):
    """`python fsdp2_transformer.py` on CPU spawns 2 processes and, in under 2 minutes and without a
    Python warning, brings the loss below ln(vocab) / 2."""
    start = time.perf_counter()
    result = run_command([sys.executable, REPO / SCRIPT], tmp_path, timeout=300)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0, result.output
    assert warning_lines(result.output) == []
    metrics = result.metrics
    assert (metrics["world_size"] == 2 and metrics["device"] == "cpu"
            and metrics["backend"] == "gloo")
    assert ("parameters (" in result.stdout
            and "are float32 DTensors sharded Shard(0)" in result.stdout)
    assert len(metrics["losses"]) == metrics["step"] == 200
    assert metrics["train_loss"] < 0.5 * math.log(128), metrics["losses"][::10]
    assert f"step 200 | loss {metrics['train_loss']:.4f} | grad norm" in result.stdout
    assert metrics["tokens_per_s"] > 0 and metrics["peak_memory_bytes"] > 0
    assert elapsed < 120, elapsed


@pytest.mark.parametrize("nproc, options", [
    pytest.param(1, ["--cpu"], marks=SMOKE("fsdp2_transformer.py")),
    (2, ["--grad-accum-steps", 2]),
    (2, ["--explicit-prefetching", "--prefetch-depth", 1, "--no-reshard-after-forward"]),
], ids=["world size 1", "grad accumulation", "explicit prefetching, no reshard after forward"])
def test_fp32_parity_with_the_plain_run(fsdp2_run, fsdp2_reference, nproc, options):
    """Same seed, same global batches: the same per-step losses and gradient norms as 2 ranks
    without options; and no Python warning, at world size 1 either."""
    result = fsdp2_run(*TINY, "--steps", 20, *options, nproc=nproc)
    assert warning_lines(result.output) == []
    run = result.metrics
    assert run["world_size"] == nproc and len(run["losses"]) == 20
    assert run["losses"] == pytest.approx(fsdp2_reference.metrics["losses"], rel=1e-5)
    assert run["grad_norms"] == pytest.approx(fsdp2_reference.metrics["grad_norms"], rel=1e-5)


def test_sharding_plan_is_read_from_the_model(fsdp2_run, fsdp2_reference):
    """What fully_shard built, as the script prints it: the plain run reshards every block after
    forward and sets no prefetching of its own; --no-reshard-after-forward and
    --explicit-prefetching --prefetch-depth 1 change exactly that (the root never reshards after
    forward)."""
    options = ["--explicit-prefetching", "--prefetch-depth", 1, "--no-reshard-after-forward"]
    none = "[]"
    assert plan(fsdp2_reference) == {"root": ("False", none, none),
                                     "layers.0": ("True", none, none),
                                     "layers.1": ("True", none, none),
                                     "layers.2": ("True", none, none)}
    assert plan(fsdp2_run(*TINY, "--steps", 20, *options)) == {
        "root": ("False", none, none), "layers.0": ("False", "['layers.1']", none),
        "layers.1": ("False", "['layers.2']", "['layers.0']"),
        "layers.2": ("False", none, "['layers.1']")}


def test_mixed_precision_with_every_option(fsdp2_run, fsdp2_reference):
    run = fsdp2_run(*TINY, "--steps", 20, "--mixed-precision", "--explicit-prefetching",
                    "--grad-accum-steps", 2, "--no-reshard-after-forward")
    assert "Unsharded parameters are bfloat16" in run.stdout
    # --prefetch-depth 2 (the default): two blocks ahead in forward, two behind in backward
    assert plan(run)["layers.0"] == ("False", "['layers.1', 'layers.2']", "[]")
    assert plan(run)["layers.2"] == ("False", "[]", "['layers.1', 'layers.0']")
    assert run.metrics["losses"] == pytest.approx(fsdp2_reference.metrics["losses"], rel=2e-2)
    # really bf16
    assert run.metrics["losses"] != pytest.approx(fsdp2_reference.metrics["losses"], rel=1e-6)


def test_sharding_halves_training_state(fsdp2_run, fsdp2_reference):
    # --cpu: the run of test_fp32_parity_with_the_plain_run[world size 1] (one cached run)
    one_rank = fsdp2_run(*TINY, "--steps", 20, "--cpu", nproc=1).metrics["train_state_bytes"]
    two_ranks = fsdp2_reference.metrics["train_state_bytes"]
    assert two_ranks <= 0.52 * one_rank, (two_ranks, one_rank)


def test_meta_init_matches_eager_init():
    """After to_empty (memory filled with NaN here), reset_parameters initializes every parameter
    as eager init does."""
    # enough values per tensor for the statistics
    config = {**CONFIG, "vocab_size": 128, "dim": 64, "seq_len": 32}
    torch.manual_seed(0)
    eager = dict(Transformer(**config).named_parameters())
    with torch.device("meta"):
        model = Transformer(**config)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(math.nan)
    model.reset_parameters()
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
        assert p.mean().item() == pytest.approx(eager[name].mean().item(), abs=2e-3), name
        assert p.std().item() == pytest.approx(eager[name].std().item(), rel=0.1, abs=1e-6), name


def test_attention_is_causal():
    """The logits at position t do not change when tokens after t do."""
    torch.manual_seed(0)
    model = Transformer(**CONFIG)
    tokens = global_batch(task_rules(64, 0), 1, 4, 16, 0)[:, :-1]
    changed = tokens.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 64
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    assert torch.equal(before[:, :8], after[:, :8])
    assert not torch.allclose(before[:, 8:], after[:, 8:])


def test_task_is_the_same_global_batch_whatever_the_world_size():
    rules = task_rules(64, 0)
    batch = global_batch(rules, 7, 8, 16, 0)
    assert torch.equal(batch, global_batch(rules, 7, 8, 16, 0))
    assert not torch.equal(batch, global_batch(rules, 8, 8, 16, 0))
    follows_a_rule = (rules[:, batch[:, :-1]] == batch[:, 1:]).all(dim=2)  # [rule, row]
    assert follows_a_rule.any(dim=0).all()


# The program is cut into adjacent literals where its lines are long: its text stays the same.
COUNT_REDUCE_SCATTERS = """
import json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
sys.path.insert(0, {repo!r})
import fsdp2_transformer as script

# Count the reduce-scatters FSDP2 issues: it calls dist.reduce_scatter_tensor (torch 2.11) or
# dist.reduce_scatter_single (2.14); only outermost calls count, should one call the other.
calls, depth = [0], [0]
for name in ("reduce_scatter_tensor", "reduce_scatter_single"):
    if hasattr(dist, name):
        def counted(*args, _original=getattr(dist, name), **kwargs):
            calls[0] += depth[0] == 0
            depth[0] += 1
            try:
                return _original(*args, **kwargs)
            finally:
                depth[0] -= 1
        setattr(dist, name, counted)

def reduce_scatters_in_one_step(grad_accum_steps):
    config = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, seq_len=16)
    with torch.device("meta"):
        model = script.Transformer(**config)
    model = script.shard_model(model, torch.device("cpu"), init_device_mesh("cpu", (2,)))
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = script.rank_batch(script.task_rules(64, 0), 12, 16, 0, dist.get_rank(), 2, 1)
    calls[0] = 0
    script.train_step(model, optimizer, tokens, grad_accum_steps)
    return calls[0]

dist.init_process_group("gloo")
counts = {{k: reduce_scatters_in_one_step(k) for k in (1, 3)}}
if dist.get_rank() == 0:
    print(json.dumps(counts))
"""


def test_gradient_accumulation_reduces_once_per_step(torchrun, tmp_path):
    """With 3 micro-batches, gradients are reduce-scattered once per FSDP unit (3 blocks + root)."""
    program = tmp_path / "count_reduce_scatters.py"
    program.write_text(distributed_program(COUNT_REDUCE_SCATTERS))
    result = torchrun(program)
    assert result.returncode == 0, result.output
    assert json.loads(result.stdout.splitlines()[-1]) == {"1": 4, "3": 4}


@SMOKE("fsdp2_transformer.py")
def test_checkpoint_from_two_ranks_resumes_on_one_with_the_other_api(torchrun, tmp_path,
                                                                      fsdp2_reference):
    """Written by 2 ranks with the DTensor API, resumed by 1 rank with the DCP API: the same
    trajectory."""
    copy_fsdp2_checkpoint(fsdp2_reference, 10, tmp_path / "ckpt")
    resumed = torchrun(SCRIPT, *TINY, "--steps", 20, "--checkpoint-dir", "ckpt", "--dcp-api",
                       nproc=1)
    assert resumed.returncode == 0, resumed.output
    assert resumed.metrics["first_step"] == 11
    assert resumed.metrics["losses"] == pytest.approx(fsdp2_reference.metrics["losses"][10:],
                                                      rel=1e-5)
    model, _ = load_files(tmp_path / "ckpt" / "step_000020")
    expected, _ = load_files(fsdp2_reference.cwd / "ckpt" / "step_000020")
    assert all(torch.allclose(model[k], expected[k], rtol=1e-5, atol=1e-6) for k in expected)


def test_a_full_checkpoint_is_read_once_per_rank_on_resume(tmp_path, fsdp2_reference):
    """Resuming from model.pt and optimizer.pt, each rank opens each file once to read it
    (memory-mapped: it reads only its shards' pages) and checks what that read loaded, never the
    files again; the run goes on as the uninterrupted one. (A copy of the script logs every open
    for reading, with Python's audit hook.)"""
    copy_fsdp2_checkpoint(fsdp2_reference, 10, tmp_path / "ckpt")
    script = script_with_lines(SCRIPT, tmp_path, "import os\n", (
        "import sys\n"
        "def opens_logged(event, args):\n"
        "    if event == 'open' and str(args[0]).endswith('.pt') and 'r' in (args[1] or ''):\n"
        "        with open(f\"opens{os.environ['RANK']}.txt\", 'a') as log:\n"
        "            print(os.path.basename(args[0]), file=log)\n"
        "sys.addaudithook(opens_logged)\n"))
    args = [*TINY, "--steps", 12, "--checkpoint-dir", "ckpt", "--save-every", 100]
    result = run_command(torchrun_command(script, args, 2), tmp_path, timeout=120)
    assert result.returncode == 0, result.output
    for rank in (0, 1):  # (read: the save at step 12 opens them to write)
        opens = (tmp_path / f"opens{rank}.txt").read_text().split()
        assert sorted(opens) == ["model.pt", "optimizer.pt"], (rank, opens)
    assert result.metrics["losses"] == pytest.approx(fsdp2_reference.metrics["losses"][10:12],
                                                      rel=1e-5)


def test_checkpoint_layout_and_plain_model(fsdp2_reference):
    """Complete folders only; model.pt loads into the plain, unsharded Transformer."""
    folder = fsdp2_reference.cwd / "ckpt"
    assert sorted(p.name for p in folder.iterdir()) == ["step_000010", "step_000020"]
    assert fsdp2_reference.metrics["checkpoint"] == str(folder / "step_000020")
    marker = json.loads((folder / "step_000020" / "COMPLETE").read_text())
    assert marker["step"] == 20 and marker["model"] == CONFIG
    model = Transformer(**CONFIG)
    model.load_state_dict(torch.load(folder / "step_000020" / "model.pt", weights_only=True))
    tokens = global_batch(task_rules(64, 0), 21, 8, 16, 0)
    with torch.no_grad():
        loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1),
                                                 tokens[:, 1:].flatten())
    assert loss.item() == pytest.approx(fsdp2_reference.metrics["train_loss"], rel=0.1)


def test_lr_sets_the_step_size_and_no_resume_overwrite_starts_over(torchrun, tmp_path,
                                                                   fsdp2_reference):
    """--no-resume --overwrite trains from step 1 although --checkpoint-dir holds step 10, which it
    deletes (without --overwrite the run refuses: the bad-input table). Step 1's loss comes before
    any update, so it is the reference's; every later one depends on --lr."""
    copy_fsdp2_checkpoint(fsdp2_reference, 10, tmp_path / "ckpt")
    result = torchrun(SCRIPT, *TINY, "--steps", 3, "--lr", 1e-4, "--checkpoint-dir", "ckpt",
                      "--no-resume", "--overwrite", "--save-every", 3)
    assert result.returncode == 0, result.output
    assert "--overwrite: deleted 1 checkpoint(s) of an earlier run" in result.stdout
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000003"]
    losses = result.metrics["losses"]
    assert result.metrics["first_step"] == 1 and losses[0] == fsdp2_reference.metrics["losses"][0]
    assert losses[1:] != pytest.approx(fsdp2_reference.metrics["losses"][1:3], rel=1e-4)


def test_a_rerun_with_nothing_left_to_train_says_so(torchrun, tmp_path, fsdp2_reference):
    """Resumed at step 20 of --steps 20: it says there is nothing to train, prints no training
    time (it printed "Wall-clock elapsed time: 0.000sec"), and still reports memory and metrics."""
    copy_fsdp2_checkpoint(fsdp2_reference, 20, tmp_path / "ckpt")
    result = torchrun(SCRIPT, *TINY, "--steps", 20, "--checkpoint-dir", "ckpt")
    assert result.returncode == 0, result.output
    assert "The checkpoint is at step 20, --steps is 20: no training" in result.stdout
    assert "elapsed time" not in result.stdout and "Peak memory per rank" in result.stdout
    assert result.metrics["losses"] == [] and result.metrics["step"] == 20


def test_divergence_stops_at_the_first_nan_and_keeps_the_last_finite_checkpoint(torchrun,
                                                                                tmp_path):
    """--lr 1e30 blows the model up: the run stops at the first non-finite loss with one error line
    naming the step, writes no metrics, and its newest checkpoint is the step before, all finite."""
    result = torchrun(SCRIPT, *TINY, "--steps", 20, "--lr", 1e30, "--checkpoint-dir", "ckpt",
                      "--save-every", 1)
    assert result.returncode != 0 and result.metrics is None
    step = int(re.search(r"error: training diverged: the loss of step (\d+) is nan",
                         single_error_line(result))[1])
    saved = sorted((tmp_path / "ckpt").glob("step_*"))
    assert saved[-1].name == f"step_{step - 1:06d}" and step > 1, saved
    model = torch.load(saved[-1] / "model.pt", weights_only=True)
    assert all(torch.isfinite(tensor).all() for tensor in model.values())


@pytest.mark.parametrize("options", [[], ["--checkpoint-format", "sharded", "--async-checkpoint"]],
                         ids=["full", "sharded async"])
def test_a_model_made_non_finite_by_the_last_step_is_never_saved(tmp_path, options):
    """The last step's loss is finite but its update leaves a weight NaN (put there by a line added
    to a copy of the script, as an overflowing update would): the run fails rather than save that
    model, and the newest checkpoint stays the step before. (An asynchronous save checks in the
    background, before its copy: its .tmp folder is removed.)"""
    script = script_with_lines(
        SCRIPT, tmp_path, " " * 37 + "max_norm=args.max_norm)\n",
        "        if step == args.steps:\n"
        "            next(model.parameters()).to_local().detach().fill_(math.nan)\n")
    args = [*TINY, "--steps", 3, "--checkpoint-dir", "ckpt", "--save-every", 1, *options]
    result = run_command(torchrun_command(script, args, 2), tmp_path, timeout=120)
    assert "training diverged: a parameter is not finite" in single_error_line(result)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_000001", "step_000002"]


def test_a_full_checkpoint_is_on_the_disk_before_its_marker(tmp_path):
    """Each save fsyncs model.pt and optimizer.pt before it writes the COMPLETE marker, then the
    marker before the rename, then the folder that holds the rename: a power cut never leaves a
    marker without its data. (A copy of the script logs every fsync; torch.save makes none of its
    own.)"""
    script = script_with_lines(SCRIPT, tmp_path, "import os\n", (
        "def fsync_logged(fd, fsync=os.fsync):\n"
        "    with open('fsync.log', 'a') as log:\n"
        "        print(os.readlink(f'/proc/self/fd/{fd}'), file=log)\n"
        "    fsync(fd)\n"
        "os.fsync = fsync_logged\n"))
    args = [*TINY, "--steps", 2, "--checkpoint-dir", "ckpt", "--save-every", 1]
    result = run_command(torchrun_command(script, args, 2), tmp_path, timeout=120)
    assert result.returncode == 0, result.output
    ckpt = tmp_path / "ckpt"
    assert (tmp_path / "fsync.log").read_text().split() == [
        str(path) for step in (1, 2) for path in (
            *(ckpt / f"step_{step:06d}.tmp" / name for name in ("model.pt", "optimizer.pt")),
            ckpt / f"step_{step:06d}.tmp" / "COMPLETE", ckpt)]


def test_log_every_sets_the_printed_steps(fsdp2_reference):
    """--log-every 5 over 20 steps: the first step, then every fifth (the last included)."""
    printed = [int(line.split()[1]) for line in fsdp2_reference.stdout.splitlines()
               if line.startswith("step ")]
    assert printed == [1, 5, 10, 15, 20]


def test_help_explains_every_flag(help_text):
    flags = ["--vocab-size", "--dim", "--n-layers", "--n-heads", "--seq-len", "--batch-size",
             "--steps", "--lr", "--seed", "--cpu", "--explicit-prefetching", "--prefetch-depth",
             "--mixed-precision", "--max-norm", "--no-reshard-after-forward", "--cpu-offload",
             "--grad-accum-steps", "--dcp-api", "--checkpoint-dir", "--save-every", "--no-resume",
             "--log-every", "--world-size", "--dist-timeout", "--metrics-json",
             "--checkpoint-format", "--async-checkpoint", "--replicate-degree",
             "--activation-checkpointing", "--compile", "--tp-degree", "--pack-documents",
             "--pad-documents"]
    text = help_text(SCRIPT)
    assert [f for f in flags if f"{f} " not in text and f"{f}," not in text] == []
    assert "(default: 200)" in text and "(default: 1.0)" in text
    # the torchtitan equivalent of each flag torchtitan users expect
    for torchtitan in ("--checkpoint.enable", "--checkpoint.async_mode async",
                       "--parallelism.data_parallel_replicate_degree", "--compile.enable",
                       "--parallelism.tensor_parallel_degree"):
        assert torchtitan in text, torchtitan


@pytest.mark.gpu
def test_cpu_offload_and_mixed_precision_on_gpu(torchrun):
    """One GPU (world size 1): CPU offload with bf16 compute trains."""
    result = torchrun(SCRIPT, "--steps", 100, "--cpu-offload", "--mixed-precision", nproc=1)
    assert result.returncode == 0, result.output
    assert result.metrics["device"] == "cuda" and result.metrics["backend"] == "nccl"
    assert result.metrics["train_loss"] < 0.5 * math.log(128)


# FSDP2_REFERENCE's losses as the script computed them before a DataLoader fed its steps (commit
# 07a9295, which built each batch in the loop): the input pipeline must feed the same tokens.
LOSSES_BEFORE_THE_DATALOADER = [
    4.167537, 4.143673, 4.095955, 4.067287, 4.088677, 4.008232, 3.957916, 3.904251, 3.921752,
    3.869981, 3.773191, 3.874228, 3.847792, 3.724806, 3.722269, 3.774118, 3.765508, 3.646113,
    3.657988, 3.628861]


@SMOKE("fsdp2_transformer.py")
def test_the_data_loader_feeds_the_same_batches(fsdp2_reference):
    assert fsdp2_reference.metrics["losses"] == pytest.approx(LOSSES_BEFORE_THE_DATALOADER,
                                                              rel=1e-5)


def test_the_summary_is_the_steady_state(fsdp2_reference):
    """The first step (start-up) and checkpoint pauses are left out: tokens/s is that of the median
    step, and every save's pause is listed, once per checkpoint."""
    metrics = fsdp2_reference.metrics
    steady = metrics["step_times_s"][metrics["warmup_steps"]:]
    assert metrics["warmup_steps"] == 1 and len(metrics["step_times_s"]) == 20
    assert metrics["step_time_s"] == statistics.median(steady)
    assert metrics["tokens_per_s"] == pytest.approx(8 * 16 / metrics["step_time_s"])
    assert metrics["step_time_s"] < metrics["step_times_s"][0]  # start-up is slower
    assert len(metrics["checkpoint_stall_s"]) == 2 and all(
        0 < s < 60 for s in metrics["checkpoint_stall_s"])
    line = next(line for line in fsdp2_reference.stdout.splitlines() if line.startswith("Trained"))
    assert f"{metrics['tokens_per_s']:,.0f} tokens/s in the steady state" in line
    assert "the first 1 step(s) and checkpoint pauses left out" in line
    assert re.search(r"Checkpoint step_000010: training paused \d+\.\d\d s",
                     fsdp2_reference.stdout)
