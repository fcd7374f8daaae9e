"""fsdp1_mnist.py and ddp_mnist.py, run for real on CPU (gloo) on the offline digits fixture."""
import importlib
import re
import subprocess
import sys

import pytest
import torch
from conftest import MNIST_TINY as TINY
from conftest import REPO, SMOKE, run_command, warning_lines
from digits_mnist import TEST_SIZE as MNIST_TEST

sys.path.insert(0, str(REPO))  # the scripts' Net, for test_saved_model_loads_into_plain_net

SCRIPTS = ["ddp_mnist.py", "fsdp1_mnist.py"]
SMOKE_SCRIPTS = [pytest.param(script, marks=SMOKE(script)) for script in SCRIPTS]


@pytest.fixture
def mnist_run(cached_torchrun, mnist_dir):
    """The reference run: 2 epochs on 2 ranks, saving the model. Cached: several tests read it."""

    def run(script, *args, nproc=2, epochs=2):
        result = cached_torchrun(script, "--data-dir", mnist_dir, "--epochs", epochs, *TINY, *args,
                                 nproc=nproc)
        assert result.returncode == 0, result.output
        return result

    return run


def accuracy_lines(output):
    return [(int(c), int(n)) for c, n in re.findall(r"Accuracy: (\d+)/(\d+) \(", output)]


@pytest.mark.parametrize("script", SMOKE_SCRIPTS)
def test_learns_digits_under_torchrun(mnist_run, script):
    run = mnist_run(script, "--save-model")
    assert warning_lines(run.output) == []
    metrics = run.metrics
    assert metrics["accuracy"] >= 0.90
    assert (metrics["world_size"] == 2 and metrics["device"] == "cpu"
            and metrics["backend"] == "gloo")
    assert metrics["train_losses"][-1] < metrics["train_losses"][0]


@pytest.mark.parametrize("script", SCRIPTS)
def test_spawn_mode_repeats_the_torchrun_run(mnist_run, mnist_dir, tmp_path, script):
    """`python script.py --cpu` spawns 2 CPU processes itself (on a free port): its first epoch is
    the torchrun run's, to the last digit. (Same seed, same command: the same losses, whichever
    launcher.)"""
    spawned = run_command([sys.executable, REPO / script, "--data-dir", mnist_dir, "--epochs", 1,
                           *TINY, "--cpu"], tmp_path, timeout=300)
    assert spawned.returncode == 0, spawned.output
    reference = mnist_run(script, "--save-model")
    assert spawned.metrics["world_size"] == 2
    assert spawned.metrics["train_losses"] == reference.metrics["train_losses"][:1]
    assert (re.findall(r"Test set: .*", spawned.stdout)
            == re.findall(r"Test set: .*", reference.stdout)[:1])


# What FSDP built, read from the wrapped model: the first line, then one per unit (name,
# parameters, those on rank 0). The whole Net has 1,199,882 parameters; fc1 has 1,179,776
# (>= 20000: its own unit).
WHOLE_NET = ["  root (Net): 1,199,882 parameters, 599,941 on rank 0"]
BUILT = {
    "FULL_SHARD": (["FULL_SHARD, backward prefetch BACKWARD_PRE, "
                    "CPU offload False, use_orig_params False",
                    "1 unit:"], WHOLE_NET),
    "--auto-wrap-min-params 20000 --use-orig-params": (
        ["FULL_SHARD, backward prefetch BACKWARD_PRE, CPU offload False, use_orig_params True",
         "2 units:"],
        ["  root (Net): 20,106 parameters, 10,053 on rank 0",
         "  fc1 (Linear): 1,179,776 parameters, 589,888 on rank 0"]),
    "--sharding-strategy SHARD_GRAD_OP --backward-prefetch BACKWARD_POST": (
        ["SHARD_GRAD_OP, backward prefetch BACKWARD_POST", "1 unit:"], WHOLE_NET),
    "--sharding-strategy HYBRID_SHARD --backward-prefetch NONE": (
        ["HYBRID_SHARD, backward prefetch NONE", "1 unit:"], WHOLE_NET),
}


@pytest.mark.parametrize("options", [
    pytest.param(options, marks=SMOKE("fsdp1_mnist.py", "ddp_mnist.py")) if options == "FULL_SHARD"
    else options for options in BUILT])
def test_fsdp_matches_ddp_in_fp32(mnist_run, options):
    """Same seed, same data order: every FSDP1 configuration reproduces DDP's per-epoch train
    losses, and prints what FSDP built from it (units, strategy, prefetch), read from the wrapped
    model, and no Python warning."""
    ddp = mnist_run("ddp_mnist.py", "--save-model").metrics["train_losses"]
    if options != "FULL_SHARD":
        run = mnist_run("fsdp1_mnist.py", *options.split(), epochs=2)
    else:
        run = mnist_run("fsdp1_mnist.py", "--save-model")
    assert warning_lines(run.output) == []
    fsdp = run.metrics["train_losses"]
    assert len(fsdp) >= 2
    assert fsdp == pytest.approx(ddp[: len(fsdp)], rel=1e-4)
    built = run.stdout.split("FSDP built ", 1)[1].splitlines()
    header, units = BUILT[options]
    assert all(part in built[0] for part in header), built[0]
    assert built[1:1 + len(units)] == units and not built[1 + len(units)].startswith("  "), built


# The strategy that BUILT leaves out, run by the 3-rank case below: test_no_shard_prints_no_warning
# reads that run too.
NO_SHARD = ["--sharding-strategy", "NO_SHARD", "--save-model"]


@pytest.mark.parametrize("script, nproc",
                         [("ddp_mnist.py", 2), ("fsdp1_mnist.py", 2), ("fsdp1_mnist.py", 3)])
def test_test_set_counted_once(mnist_run, script, nproc):
    """DistributedSampler pads 295 test samples to 296 (2 ranks) or 297 (3 ranks); the padding is
    not counted."""
    result = (mnist_run(script, "--save-model") if nproc == 2
              else mnist_run(script, *NO_SHARD, nproc=3, epochs=1))
    counts = accuracy_lines(result.stdout)
    assert counts, result.stdout
    assert all(n == MNIST_TEST for _, n in counts), counts
    assert result.metrics["accuracy"] == pytest.approx(counts[-1][0] / MNIST_TEST)


@pytest.mark.parametrize("nproc", [3, 1])
def test_no_shard_prints_no_warning(mnist_run, nproc):
    """FSDP1 warns that NO_SHARD is deprecated (world size > 1) and, at every save of a NO_SHARD
    model, that it returns a full state dict; the script filters exactly these two. At world size
    1 every strategy runs as NO_SHARD, and the script says so itself."""
    if nproc == 3:  # test_test_set_counted_once's run
        run = mnist_run("fsdp1_mnist.py", *NO_SHARD, nproc=3, epochs=1)
    else:
        run = mnist_run("fsdp1_mnist.py", "--save-model", "--dry-run", nproc=1, epochs=1)
        assert "FULL_SHARD with one process: NO_SHARD" in run.stdout
    assert "FSDP built 1 unit: NO_SHARD" in run.stdout and "Saved " in run.stdout
    assert warning_lines(run.output) == []


@pytest.mark.parametrize("script", SMOKE_SCRIPTS)
def test_saved_model_loads_into_plain_net(mnist_run, mnist_dir, script):
    """The run's mnist_cnn.pt (no .tmp left) loads, weights only, into the script's plain Net, no
    FSDP or DDP around it, which scores the run's accuracy on the whole test set. Loaded in the
    test's process: a new Python would import torch and torchvision again (4-5 s of CPU)."""
    from torchvision import datasets, transforms  # for this test only

    run = mnist_run(script, "--save-model")
    assert (run.cwd / "mnist_cnn.pt").exists() and not list(run.cwd.glob("*.tmp"))
    net = importlib.import_module(script[:-3]).Net()
    net.load_state_dict(torch.load(run.cwd / "mnist_cnn.pt", weights_only=True))
    net.eval()
    normalize = transforms.Compose([transforms.ToTensor(),
                                    transforms.Normalize((0.1307,), (0.3081,))])
    test_set = datasets.MNIST(mnist_dir, train=False, transform=normalize)
    images = torch.stack([image for image, _ in test_set])
    with torch.no_grad():
        correct = (net(images).argmax(1) == test_set.targets).sum().item()
    assert correct / MNIST_TEST == pytest.approx(run.metrics["accuracy"], abs=1e-9)


def test_fsdp_full_shard_halves_training_state(mnist_run):
    fsdp = mnist_run("fsdp1_mnist.py", "--save-model").metrics["train_state_bytes"]
    ddp = mnist_run("ddp_mnist.py", "--save-model").metrics["train_state_bytes"]
    assert fsdp <= 0.55 * ddp, (fsdp, ddp)


def test_seed_changes_the_run(mnist_run):
    """Another --seed, another initialization and data order: another loss of the first batch.
    One batch each (--dry-run) shows it as an epoch of 24 did: a dry run's loss is the initial
    weights' on the first batch, taken before its one step. The seed-1 run is
    test_dry_run_stops_after_one_batch's. (That the same seed repeats a run exactly is
    test_spawn_mode_repeats_the_torchrun_run.)"""
    result = mnist_run("fsdp1_mnist.py", "--dry-run", "--seed", 2, epochs=1)
    seed_1 = mnist_run("fsdp1_mnist.py", "--dry-run", epochs=1).metrics["train_losses"][0]
    assert result.metrics["train_losses"][0] != pytest.approx(seed_1, rel=1e-4)


@pytest.mark.parametrize("script", SCRIPTS)
def test_lr_and_gamma_drive_the_optimizer(torchrun, mnist_dir, mnist_run, script):
    """--lr sets the first epoch's steps; --gamma 0 makes the learning rate 0 from epoch 2,
    freezing the model."""
    result = torchrun(script, "--data-dir", mnist_dir, "--epochs", 2, *TINY, "--lr", 0.5,
                      "--gamma", 0)
    assert result.returncode == 0, result.output
    default_lr = mnist_run(script, "--save-model").metrics["train_losses"][0]
    assert result.metrics["train_losses"][0] != pytest.approx(default_lr, rel=1e-4)
    test_lines = re.findall(r"Test set: .*", result.stdout)
    assert len(test_lines) == 2 and test_lines[0] == test_lines[1], test_lines


def test_dry_run_stops_after_one_batch(mnist_run):
    result = mnist_run("fsdp1_mnist.py", "--dry-run", epochs=1)  # test_seed_changes_the_run's too
    # one batch of 100 per rank
    assert accuracy_lines(result.stdout) == [(result.metrics["accuracy"] * 200, 200)]


def test_spawn_mode_reports_missing_data_once(tmp_path):
    result = run_command([sys.executable, REPO / "ddp_mnist.py", "--data-dir",
                          tmp_path / "missing"], tmp_path, timeout=60)
    assert result.returncode == 1
    assert result.stderr.count("error: MNIST is not in") == 1 and "Traceback" not in result.stderr


def test_digits_fixture_without_scikit_learn_says_what_to_install(tmp_path):
    """`python tests/digits_mnist.py DIR` (the README's offline MNIST) without scikit-learn: one
    line naming the package, no traceback, no folder."""
    hidden = ("import runpy, sys; sys.modules['sklearn'] = None; "  # as if it were not installed
              f"sys.argv = [{str(REPO / 'tests' / 'digits_mnist.py')!r}, 'data']; "
              "runpy.run_path(sys.argv[0], run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", hidden], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and proc.stdout == ""
    assert (len(proc.stderr.splitlines()) == 1
            and "pip install scikit-learn" in proc.stderr), proc.stderr
    assert not (tmp_path / "data").exists()


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_explains_every_flag(help_text, script):
    flags = ["--batch-size", "--test-batch-size", "--epochs", "--lr", "--gamma", "--seed", "--cpu",
             "--no-cuda", "--save-model", "--data-dir", "--dry-run", "--world-size",
             "--dist-timeout", "--metrics-json"]
    if script == "fsdp1_mnist.py":
        flags += ["--auto-wrap-min-params", "--cpu-offload", "--sharding-strategy",
                  "--backward-prefetch", "--use-orig-params"]
    text = help_text(script)
    assert [f for f in flags if f not in text] == []
    assert "(default: 64)" in text and "(default: 1000)" in text


@pytest.mark.gpu
def test_cpu_offload_on_gpu(torchrun, mnist_dir):
    """One GPU (world size 1): CPU offload trains, and the time is measured with CUDA events."""
    result = torchrun("fsdp1_mnist.py", "--data-dir", mnist_dir, "--epochs", 3, *TINY,
                      "--cpu-offload", "--auto-wrap-min-params", "20000", nproc=1)
    assert result.returncode == 0, result.output
    assert result.metrics["device"] == "cuda" and result.metrics["backend"] == "nccl"
    assert result.metrics["accuracy"] >= 0.90
    assert "CUDA event elapsed time" in result.stdout
