"""fsdp2_transformer.py --tp-degree: FSDP2 with tensor parallel on a 2-D (or 3-D) mesh, run for
real on 4 CPU ranks (gloo): the losses of 1-D FSDP and of one process, checkpoints that move
between layouts bit for bit, --plan, and one line for every layout that cannot work."""
import json
import re
import shutil
import sys

import pytest
import torch
from conftest import (
    FSDP2_SHARDED,
    FSDP2_TINY,
    REPO,
    distributed_program,
    full_state_of,
    plan_of,
    queue_cached_run,
    warning_lines,
)

sys.path.insert(0, str(REPO))
from fsdp2_transformer import Transformer, tensor_parallel_plan  # noqa: E402
from safeguards.fsdp2_plan import memory_plan  # noqa: E402

SCRIPT = "fsdp2_transformer.py"
CONFIG = {"vocab_size": 64, "dim": 32, "n_layers": 3, "n_heads": 4, "seq_len": 16}  # TINY's sizes
TP = [*FSDP2_TINY, "--steps", 20, "--tp-degree", 2]  # 20 steps of FSDP2_TINY on a (2, 2) mesh
# torch's own warning log lines ("[rank0]:W1126 ..."), which warning_lines does not see
TORCH_WARNING = re.compile(r"^\[rank\d+\]:W\d{4} ", re.M)


# The runs of TP's own (not the 1-D ones that other files read too): started early (start_early)
TP_REFERENCE = ["--checkpoint-dir", "ckpt", "--save-every", 10, "--checkpoint-format", "sharded",
                "--async-checkpoint"]
# HSDP's comparison needs 10 steps: the reference clips every one of them (norms 1.02-1.66)
TP_HSDP = ["--replicate-degree", 2, "--grad-accum-steps", 2, "--activation-checkpointing",
           "--checkpoint-dir", "ckpt", "--steps", 10, "--save-every", 10]
TP_MIXED = ["--mixed-precision", "--explicit-prefetching", "--steps", 10]


def start_early(request):
    """Queue TP's own runs as the session starts (conftest): they run at the lowest priority on
    the cores the other tests leave idle, and this file's tests, which run last, wait for them."""
    if any("tp_run" in getattr(item, "fixturenames", ()) for item in request.session.items
           if getattr(item, "module", None) is sys.modules[__name__]):
        for options in (TP_REFERENCE, TP_HSDP, TP_MIXED):
            queue_cached_run(request, SCRIPT, *TP, *options, nproc=4)


@pytest.fixture(scope="session")
def tp_run(cached_torchrun):
    """run(*options): TP plus options on 4 ranks, cached for the session; it must succeed."""

    def run(*options):
        result = cached_torchrun(SCRIPT, *TP, *options, nproc=4)
        assert result.returncode == 0, result.output
        return result

    return run


@pytest.fixture(scope="session")
def tp_reference(tp_run):
    """(dp 2, tp 2), with sharded checkpoints written in the background at steps 10 and 20."""
    return tp_run(*TP_REFERENCE)


@pytest.fixture
def one_process(cached_torchrun):
    result = cached_torchrun(SCRIPT, *FSDP2_TINY, "--steps", 20, "--cpu", nproc=1)
    assert result.returncode == 0, result.output
    return result


def test_tensor_parallel_trains_the_same_model(tp_reference, tp_run, fsdp2_reference,
                                               one_process):
    """(dp 2, tp 2) for 20 steps, and (replicate 2, shard 1, tp 2) with gradient accumulation and
    activation checkpointing for 10: per step, the losses and gradient norms (the norm over both
    mesh dimensions, which clipping at 1.0 uses: the reference's exceed it) of 1-D FSDP on 2 ranks
    and of one process, within 1e-5; each rank holds its 2-D part; no warning, torch's log
    included."""
    hsdp = tp_run(*TP_HSDP)
    reference = fsdp2_reference.metrics
    assert min(reference["grad_norms"][:10]) > 1.0  # clipped at each step of both runs
    for run, layout, steps in [
            (tp_reference, "sharded Shard(0) over 2 ranks", 20),
            (hsdp, "replicated over 2 ranks and sharded Shard(0) over 1 rank (HSDP)", 10)]:
        assert f"{layout}, tensor parallel over 2 ranks (25 split, 20 replicated)" in run.stdout
        assert warning_lines(run.output) == [] and not TORCH_WARNING.search(run.output)
        assert len(run.metrics["losses"]) == steps
        for other in (reference, one_process.metrics):
            assert run.metrics["losses"] == pytest.approx(other["losses"][:steps], rel=1e-5)
            assert run.metrics["grad_norms"] == pytest.approx(other["grad_norms"][:steps],
                                                              rel=1e-5)
    assert "activation checkpointing: 3 of 3" in hsdp.stdout
    # Half the state per rank of the 1-D run on half the ranks: tensor parallel splits each layer
    # over 2 ranks (FSDP2 then shards that part over "dp", HSDP replicates it)
    assert tp_reference.metrics["train_state_bytes"] < 0.6 * reference["train_state_bytes"]
    assert hsdp.metrics["train_state_bytes"] < 0.6 * one_process.metrics["train_state_bytes"]
    # The full format gathers the 3-D layout into a plain model.pt, the 1-D run's: a Transformer
    # loads it, and its values differ by float32 rounding (the layouts reduce in other orders),
    # which AdamW's division by the root of tiny second moments grows to 5e-6 at most.
    model = torch.load(hsdp.cwd / "ckpt" / "step_000010" / "model.pt", weights_only=True)
    expected = torch.load(fsdp2_reference.cwd / "ckpt" / "step_000010" / "model.pt",
                          weights_only=True)
    Transformer(**CONFIG).load_state_dict(model)
    assert all(torch.allclose(model[k], expected[k], rtol=0, atol=1e-5) for k in expected)


def test_mixed_precision_under_tensor_parallel(tp_run, fsdp2_reference):
    """bf16 compute, fp32 reduction, with explicit prefetching, 10 steps: within 2e-2 of the fp32
    losses, as 1-D FSDP's mixed precision is (tests/test_fsdp2.py). bf16 keeps 8 significant
    bits: each logit is off by up to 2^-8 of itself, and AdamW's steps carry such differences
    on; the losses measured differ by about 2e-4, and really are not the fp32 ones."""
    run = tp_run(*TP_MIXED)
    assert "Unsharded parameters are bfloat16" in run.stdout
    losses = fsdp2_reference.metrics["losses"][:10]
    assert run.metrics["losses"] == pytest.approx(losses, rel=2e-2)
    assert run.metrics["losses"] != pytest.approx(losses, rel=1e-6)


def resumed(cached_torchrun, tmp_path_factory, checkpoint, args, nproc):
    """A run of args on nproc ranks from a copy of checkpoint, the only one in its folder."""
    folder = tmp_path_factory.mktemp("resume") / "ckpt"
    shutil.copytree(checkpoint, folder / checkpoint.name)
    result = cached_torchrun(SCRIPT, *args, "--checkpoint-dir", folder, nproc=nproc)
    assert result.returncode == 0, result.output
    assert f"Resumed from {folder / checkpoint.name} at step 10" in result.stdout
    return result


def test_checkpoints_resume_in_another_layout(cached_torchrun, tmp_path_factory, tp_reference,
                                              fsdp2_sharded_reference):
    """The (2, 2) run's asynchronous checkpoint of step 10 resumes at 1-D on 2 ranks; a 1-D
    checkpoint of 2 ranks resumes at (1, 4) on 4: the trajectories of the runs that wrote them."""
    to_1d = resumed(cached_torchrun, tmp_path_factory,
                    tp_reference.cwd / "ckpt" / "step_000010",
                    [*FSDP2_TINY, "--steps", 20, "--checkpoint-format", "sharded"], nproc=2)
    assert to_1d.metrics["losses"] == pytest.approx(tp_reference.metrics["losses"][10:],
                                                    rel=1e-5)
    sizes = [arg for arg in FSDP2_SHARDED if arg != "--async-checkpoint"]  # dim 128
    to_tp4 = resumed(cached_torchrun, tmp_path_factory,
                     fsdp2_sharded_reference.cwd / "ckpt" / "step_000010",
                     [*sizes, "--tp-degree", 4], nproc=4)
    assert "tensor parallel over 4 ranks" in to_tp4.stdout
    assert to_tp4.metrics["losses"] == pytest.approx(
        fsdp2_sharded_reference.metrics["losses"][10:], rel=1e-5)


# Loads a checkpoint into a layout and saves it again, through the script's own units, on 2 ranks:
# (dp 2, tp 2)'s asynchronous sharded checkpoint of step 10 into (1, 2), saved sharded; that into
# 1-D FSDP, saved full (model.pt); that into (1, 2) again, saved sharded.
RELAYOUT = """
import sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
sys.path.insert(0, {repo!r})
import fsdp2_transformer as script

dist.init_process_group("gloo")
config = dict(vocab_size=64, dim=32, n_layers=3, n_heads=4, seq_len=16)
tp_mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
flat = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
source = {source!r}
tp_plan = script.tensor_parallel_plan()
for mesh, plan, folder, kind in [(tp_mesh, tp_plan, "tp2", "sharded"), (flat, None, "flat", "full"),
                                 (tp_mesh, tp_plan, "tp2_again", "sharded")]:
    with torch.device("meta"):
        model = script.Transformer(**config)
    model = script.shard_model(model, torch.device("cpu"), mesh, tp_plan=plan)
    optimizer = torch.optim.AdamW(model.parameters())
    assert script.Checkpointer(None, config).load(model, optimizer, source) == 10
    source = f"{{sys.argv[1]}}/{{folder}}/step_000010"
    script.Checkpointer(f"{{sys.argv[1]}}/{{folder}}", config, kind).save(model, optimizer, 10)
    del model, optimizer
"""


def test_checkpoints_change_layout_bit_for_bit(tp_reference, torchrun, tmp_path):
    """What a layout loads is what it saves again, bit for bit: the (2, 2) checkpoint of 4 ranks
    through (1, 2), 1-D and (1, 2) on 2 ranks, saved sharded, full (a plain model.pt), sharded."""
    program = tmp_path / "relayout.py"
    written = tp_reference.cwd / "ckpt" / "step_000010"
    program.write_text(distributed_program(RELAYOUT, source=str(written)))
    result = torchrun(program, tmp_path, nproc=2)
    assert result.returncode == 0, result.output
    expected = full_state_of(written)
    for folder in ("tp2", "flat", "tp2_again"):
        state = full_state_of(tmp_path / folder / "step_000010")
        assert state.keys() == expected.keys(), folder
        assert all(torch.equal(state[k], expected[k]) for k in expected), folder


# What autograd saves for backward in one forward of (1, 2) on 2 ranks, each tensor counted by
# its bytes on this rank (a DTensor's local part), with and without activation checkpointing.
SAVED_FOR_BACKWARD = """
import contextlib, gc, json, sys
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
sys.path.insert(0, {repo!r})
import fsdp2_transformer as script

def saved_bytes(activation_checkpointing):
    with torch.device("meta"):
        model = script.Transformer(vocab_size=64, dim=32, n_layers=3, n_heads=4, seq_len=16)
    model.activation_checkpointing = activation_checkpointing
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    model = script.shard_model(model, torch.device("cpu"), mesh,
                               tp_plan=script.tensor_parallel_plan())
    tokens = script.global_batch(script.task_rules(64, 0), 1, 8, 16, 0)  # every row: dp is 1
    saved = []
    def pack(tensor):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        saved.append(local.numel() * local.element_size())
        return tensor
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), loss_parallel():
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                          tokens[:, 1:].flatten()).backward()
    return sum(saved)

dist.init_process_group("gloo")
counts = {{"plain": saved_bytes(False), "checkpointed": saved_bytes(True)}}
if dist.get_rank() == 0:
    print(json.dumps(counts))
"""


def test_plan_counts_the_tensor_parallel_state(tp_reference, torchrun, tmp_path):
    """--plan at (2, 2): the training state per rank that the run measured, to the byte; at (1, 2)
    what autograd saves for backward on a rank (sequence parallel splits the norms' inputs and
    the residual stream, colwise q, k, v and the MLP's hidden units; q, k, v and the MLP read
    all-gathered inputs), counted with saved-tensor hooks, within 1%."""
    plan = plan_of(SCRIPT, tmp_path, *TP, "--world-size", 4)
    assert plan["train_state_bytes"] == tp_reference.metrics["train_state_bytes"]
    assert "world size 4 (2 shards x tensor parallel 2)" in plan["printed"]
    program = tmp_path / "saved_for_backward.py"
    program.write_text(distributed_program(SAVED_FOR_BACKWARD))
    result = torchrun(program)
    assert result.returncode == 0, result.output
    saved = json.loads(result.stdout.splitlines()[-1])
    with torch.device("meta"):
        model = Transformer(**CONFIG)
    for kind, checkpointed in (("plain", False), ("checkpointed", True)):
        predicted = memory_plan(model, 2, 1, 8, 1, False, False, True, 1, checkpointed, tp=2,
                                tp_plan=tensor_parallel_plan())
        assert predicted["saved_for_backward_bytes"] == pytest.approx(saved[kind], rel=0.01)


BAD_LAYOUTS = [  # flags (after FSDP2_TINY, on 4 ranks unless they say), what the line says
    (["--tp-degree", 3], "--tp-degree 3 does not divide the world size 4 and the 4 processes "
                         "per node"),
    (["--tp-degree", 4, "--n-heads", 2], "--n-heads 2 is not divisible by --tp-degree 4"),
    (["--tp-degree", 4, "--seq-len", 6], "--seq-len 6 is not divisible by --tp-degree 4"),
    (["--tp-degree", 4, "--vocab-size", 66], "--vocab-size 66 is not divisible by --tp-degree 4"),
    (["--tp-degree", 2, "--batch-size", 3], "--batch-size 3 (the global batch) is not divisible "
                                            "by world size 4 / --tp-degree 2"),
    (["--tp-degree", 2, "--replicate-degree", 4], "--replicate-degree 4 does not divide the world "
                                                  "size 4 / --tp-degree 2"),
    (["--tp-degree", 4, "--world-size", 8], "does not divide the world size 8 and the 2 "
                                            "processes per node"),
]


@pytest.mark.parametrize("flags, line", BAD_LAYOUTS, ids=[" ".join(map(str, flags))
                                                          for flags, _ in BAD_LAYOUTS])
def test_a_bad_layout_is_refused_in_one_line(monkeypatch, flags, line):
    """Every layout that cannot work is refused by the flag checks, in one line (a run stops with
    it before training: main applies them). The last has 2 processes per node (LOCAL_WORLD_SIZE,
    as torchrun sets it on 4 nodes of 2): a tensor parallel group must sit on one node."""
    import fsdp2_transformer
    from safeguards.fsdp2_checks import flag_problem

    args = fsdp2_transformer.parse_args([str(flag) for flag in [*FSDP2_TINY, *flags]])
    if args.world_size:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    problem = flag_problem(args, torch.device("cpu"), args.world_size or 4)
    assert problem and line in problem, problem
