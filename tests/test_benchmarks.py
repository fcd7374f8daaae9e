"""benchmarks/run.py, run for real on the cheapest configuration.

FSDP2, 5 steps, 3 runs at world size 1. The same harness run also asks for world size 3, which the
script refuses (its global batch of 32 does not split over 3 ranks): a real failed run, which must
be shown and fail the harness without hiding the rest.
"""
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from conftest import REPO, Idle, processes_left

# The runner's modules (run.py, bench/, t5_memory.py), imported by the tests that read them
sys.path.insert(0, str(REPO / "benchmarks"))

HEADERS = ["world size", "options", "train state / rank (MiB)", "state vs world size 1",
           "ideal 1/N", "peak RSS / rank (MiB)", "time / step (ms)", "tokens/s",
           "tokens/s vs plain"]
# Table column -> (per-run figure in the raw JSON, decimals printed)
MEDIANS = {"train state / rank (MiB)": ("state_mib", 3), "peak RSS / rank (MiB)": ("peak_mib", 1),
           "time / step (ms)": ("step_ms", 2), "tokens/s": ("tokens_per_s", 0)}


RUN = {}  # "harness": the harness command, an Idle run


def start_early(request):
    """Start the harness at the lowest priority as the session starts (conftest): it runs on the
    cores the other tests leave idle, and the tests that read it, which run last, wait for it."""
    if not any("harness" in getattr(item, "fixturenames", ()) for item in request.session.items):
        return  # none of the tests that read it is selected (pytest -k)
    tmp = request.getfixturevalue("tmp_path_factory").mktemp("benchmarks")
    command = [sys.executable, REPO / "benchmarks" / "run.py", "--only", "fsdp2", "--fsdp2-steps",
               "5", "--fsdp2-world-sizes", "1", "3", "--fsdp2-options", "plain", "--repeats", "3",
               "--out", tmp / "tables.md", "--raw-json", tmp / "runs.json"]
    # One thread per process, as torchrun gives 2 ranks: a lone process would take every core,
    # and OpenMP's spinning threads make it several times slower while other tests run.
    RUN["harness"] = Idle(request, command, tmp, env={**os.environ, "OMP_NUM_THREADS": "1"})


@pytest.fixture(scope="module")
def harness():
    run = RUN["harness"]
    returncode, stdout, stderr = run.wait(timeout=600)
    raw = json.loads((run.cwd / "runs.json").read_text())
    return (subprocess.CompletedProcess([], returncode, stdout, stderr),
            (run.cwd / "tables.md").read_text(), raw["runs"])


def table_rows(markdown):
    """{world size: row as {header: cell}} of the one markdown table in the output."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")]
    headers = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert headers == HEADERS, headers
    rows = [dict(zip(headers, (cell.strip() for cell in line.strip("|").split("|"))))
            for line in lines[2:]]
    return {int(row["world size"]): row for row in rows}


def test_table_shows_the_median_of_the_runs(harness):
    proc, markdown, runs = harness
    assert markdown in proc.stdout  # --out holds what was printed
    assert "torch " in markdown and "CPU cores" in markdown and "median of 3 runs" in markdown
    good = [run for run in runs if run["world_size"] == 1]
    assert len(good) == 3 and all(run["returncode"] == 0 for run in good)
    for run in good:  # the figures are the script's own metrics, in the table's units
        metrics, figures = run["metrics"], run["figures"]
        assert metrics["world_size"] == 1 and len(metrics["losses"]) == 5
        assert figures["state_mib"] == metrics["train_state_bytes"] / 2**20
        assert figures["tokens_per_s"] == metrics["tokens_per_s"]
        assert figures["step_ms"] == pytest.approx(1000 * 32 * 32 / metrics["tokens_per_s"])

    row = table_rows(markdown)[1]
    assert row["options"] == "plain"
    for column, (figure, decimals) in MEDIANS.items():
        median = statistics.median(run["figures"][figure] for run in good)
        printed = float(row[column].replace(",", ""))
        assert printed == pytest.approx(median, abs=0.51 * 10**-decimals), column
    assert (row["state vs world size 1"] == row["ideal 1/N"] == "1.000"
            and row["tokens/s vs plain"] == "1.00")


def test_a_failed_run_is_shown_and_fails_the_harness(harness):
    proc, markdown, runs = harness
    assert proc.returncode == 1
    failed = [run for run in runs if run["world_size"] == 3]
    assert len(failed) == 1 and failed[0]["returncode"] != 0  # its other 2 runs were not attempted
    # The script's own error line, in the stderr the harness prints.
    assert re.search(r"FAILED: fsdp2 cpu world size 3 plain, run 1/3, exit status [1-9]",
                     proc.stderr), proc.stderr
    assert ("error: --batch-size 32 (the global batch) is not divisible by world size 3"
            in proc.stderr)
    row = table_rows(markdown)[3]
    assert (row["options"] == "plain (FAILED)" and row["tokens/s"] == "n/a"
            and row["state vs world size 1"] == "n/a")
    assert "1 FAILED" in markdown


def test_lora_benchmark_runs_what_it_says():
    """--only lora generation --dry-run: their commands, without writing or training the 198M
    model. generation: FSDP1 and FSDP2, each with the parameters gathered once and block by
    block, on 2 CPU ranks, the same model without </s> in its generation config."""
    proc = subprocess.run([sys.executable, REPO / "benchmarks" / "run.py", "--only", "lora",
                           "generation", "--dry-run"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    runs = [line.split() for line in proc.stdout.splitlines() if "torch.distributed.run" in line]
    generation = [" ".join(run) for run in runs if "--rouge" in run]
    runs = [run for run in runs if "--rouge" not in run]
    assert sorted((run.split("--fsdp-version ")[1][0], run.split("--generate ")[1].split()[0])
                  for run in generation) == [(v, way) for v in "12"
                                             for way in ("by-block", "gathered")]
    assert all("t5-base-shape-no-eos" in run and "--nproc_per_node 2" in run and "--cpu" in run
               for run in generation)
    plans = [line.split() for line in proc.stdout.splitlines() if "--plan" in line]
    rows = {(run[run.index("--fsdp-version") + 1], "--lora-rank 16" in " ".join(run),
             "--base-dtype bf16" in " ".join(run), run[6].split("/")[-2]) for run in runs}
    here = REPO.name  # the default AdamW runs the script itself, the others a copy
    assert len(runs) == 10 and rows == {
        (v, lora, bf16, here) for v in "12" for lora, bf16 in
        ((False, False), (True, False), (True, True))} | {
        (v, False, False, f"adamw-{option}") for v in "12" for option in ("foreach", "fused")}
    assert all("t5-base-shape" in " ".join(run) and "--nproc_per_node 2" in " ".join(run)
               for run in runs)
    # 8 curves, for the measured shape and t5-base's own vocabulary
    assert len(plans) == 16 and sum("--sharding-strategy NO_SHARD" in " ".join(plan)
                                    for plan in plans) == 2


def test_export_and_gpu_benchmarks_run_what_they_say():
    """--only hf-export lora-gpu gpu-check --dry-run (no GPU needed to list them): hf-export runs
    FSDP2 with LoRA, loading shard by shard and saving, at 2 and 4 ranks, each once shard by shard
    and once gathered (--full-state-dict); lora-gpu the six LoRA rows on one process, not on the
    CPU; gpu-check pytest -m gpu, C1B's three rows and T5's six (full and LoRA: FSDP1, FSDP2,
    FSDP2 compiled) on one GPU. Without a GPU, gpu-check refuses in one line."""
    proc = subprocess.run([sys.executable, REPO / "benchmarks" / "run.py", "--only", "hf-export",
                           "lora-gpu", "gpu-check", "--dry-run"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    runs = [line for line in proc.stdout.splitlines() if "torch.distributed.run" in line]
    export = [run for run in runs if "--cpu-ram-efficient-loading" in run]
    assert sorted((run.split("--nproc_per_node ")[1][0], "--full-state-dict" in run)
                  for run in export) == [("2", False), ("2", True), ("4", False), ("4", True)]
    assert all("--fsdp-version 2" in run and "--lora-rank 16" in run
               and "--no-save-model" not in run and "--no-run-validation" not in run
               for run in export)
    gpu = [run for run in runs if run not in export and "--num-train-samples 256" in run]
    assert len(gpu) == 6 and all("--nproc_per_node 1" in run and "--cpu" not in run.split()
                                 and "--mixed-precision bf16" in run for run in gpu)
    assert sorted(("--lora-rank" in run, "--base-dtype bf16" in run, run.split()[-3])
                  for run in gpu) == sorted((lora, bf16, v) for v in "12" for lora, bf16 in
                                            ((False, False), (True, False), (True, True)))
    check = [run for run in runs if run not in export and run not in gpu]
    assert any(line.endswith("-m pytest -m gpu -n auto -v -rfE -p no:cacheprovider "
                             + str(REPO / "tests")) for line in proc.stdout.splitlines())
    c1b = [run for run in check if "fsdp2_transformer.py" in run]
    assert len(c1b) == 3 and sum("--float8 tensorwise" in run for run in c1b) == 1
    assert sum("--async-checkpoint" in run and "--save-every 100" in run for run in c1b) == 1
    t5 = sorted(("--lora-rank 16" in run, run.split("--fsdp-version ")[1][0], "--compile" in run)
                for run in check if "t5_fsdp_finetune.py" in run)
    assert t5 == sorted((lora, v, compiled) for lora in (False, True)
                        for v, compiled in (("1", False), ("2", False), ("2", True)))
    assert all("--nproc_per_node 1" in run for run in check)
    # One run of each row by default, and of pytest -m gpu always: the runner's --repeats 3 made
    # it 30 runs, three of them the GPU tests, which alone outlasted 9 minutes on an H200.
    import bench
    import run as runner
    from bench import gpu_check

    # --gpu-check-parts: a lent GPU's minutes split over two commands
    for argv, runs in (([], 10), (["--gpu-check-repeats", "3"], 28),
                       (["--gpu-check-parts", "t5"], 6),
                       (["--gpu-check-parts", "pytest", "c1b"], 4)):
        args = runner.parse_args(bench.load(), ["--only", "gpu-check", "--dry-run", *argv])
        configs = gpu_check.runs(SimpleNamespace(args=args, lora_model="t5", lora_data="data"))
        assert sum(config["repeats"] for config in configs) == runs, argv
        # the header says so, not the runner's --repeats 3 (a median of 3 runs)
        assert gpu_check.figures_note(args) == (
            f"gpu-check: {'median of 3 runs' if '3' in argv else 'one run'} per row "
            "(--gpu-check-repeats), pytest -m gpu once."), argv
    if not torch.cuda.is_available():
        refused = subprocess.run([sys.executable, REPO / "benchmarks" / "run.py", "--only",
                                  "gpu-check"], capture_output=True, text=True, timeout=120)
        assert refused.returncode == 2 and refused.stderr.splitlines()[-1].endswith(
            "error: gpu-check checks a CUDA GPU, and none is visible here: run it where one is "
            "lent"), refused.stderr


def test_gpu_check_without_xdist_refuses_in_one_line(monkeypatch, capsys):
    """Where a GPU is visible but pytest-xdist is not installed (a lent GPU's image, its wheel not
    carried), gpu-check stops at once in one line that says what to install or how to leave the
    GPU tests out, rather than fail its pytest row on "unrecognized arguments: -n"."""
    import bench
    import run as runner

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # (only the check asks)
    monkeypatch.setitem(sys.modules, "xdist", None)  # as if not installed: importing it fails
    with pytest.raises(SystemExit) as refused:
        runner.parse_args(bench.load(), ["--only", "gpu-check"])
    assert refused.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: gpu-check runs the GPU tests side by side with pytest-xdist, which is not "
        "installed: pip install -r requirements-test.txt (or leave them out: --gpu-check-parts "
        "c1b t5)")
    runner.parse_args(bench.load(), ["--only", "gpu-check", "--gpu-check-parts", "c1b", "t5"])


def test_gpu_check_names_the_slowest_the_failed_and_the_stopped_tests(tmp_path):
    """gpu-check's pytest run, on a file of four tests instead of the GPU tests, side by side on
    pytest-xdist's workers: its row gives the counts and each test's own time (the slowest, to
    size the check by), and a failed test's name and error line reach the stderr that the runner
    prints for a failed run; stopped by its time limit, it says which tests had ended and which
    were running, and the processes a test started are stopped too."""
    from bench import gpu_check

    (tmp_path / "test_four.py").write_text(
        "import time\n"
        "def test_slow():\n    time.sleep(1.2)\n"
        "def test_quick():\n    pass\n"
        "def test_wrong():\n    assert 1 == 2, 'one is not two'\n"
        "def test_stuck():\n"  # and a process it started, as a GPU test starts torchrun
        "    import subprocess\n"
        "    subprocess.Popen(['sleep', '300'])\n"
        "    time.sleep(300)\n")
    config = {"kind": "pytest", "name": gpu_check.PYTEST}
    command = gpu_check.command(config, tmp_path / "metrics.json")
    assert command[-1] == str(REPO / "tests") and "-v" in command
    marker = command.index("gpu")  # the four tests are not marked: -k picks them
    command[marker - 1:marker + 1] = ["-k"]

    def run(tests, timeout):
        return gpu_check.run(config, [*command[:marker], tests, *command[marker:-1],
                                      str(tmp_path / "test_four.py")],
                             tmp_path, env=os.environ, timeout=timeout)

    returncode, stdout, stderr, _ = run("not stuck", timeout=120)
    assert returncode == 1, stdout + stderr
    assert stderr.splitlines()[-1].startswith("FAILED ") and "test_wrong" in stderr, stderr
    assert "one is not two" in stderr, stderr
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["passed"] == 2 and metrics["failed"] == 1
    # Its own 1.2 s, give or take how late each line reaches the runner (in CI once: 1.1988 s)
    assert metrics["slowest"][0][0] == "test_slow" and 1 < metrics["slowest"][0][1] < 10
    assert dict(metrics["slowest"])["test_quick"] < 1  # not the 1.2 s of the test beside it
    returncode, stdout, stderr, _ = run("quick or stuck", timeout=8)
    assert returncode != 0 and re.fullmatch(
        r"pytest -m gpu stopped at 8 s, after 1 of 2 tests: test_quick 0 s; still running: "
        r"test_stuck \d s", stderr.splitlines()[-1]), stderr
    assert json.loads((tmp_path / "metrics.json").read_text())["passed"] == 1
    assert processes_left(tmp_path, grace=10) == []  # the test's `sleep` stopped with it


def test_a_stopped_harness_keeps_what_it_measured(tmp_path):
    """--out and --raw-json are written after every run: a harness stopped by a time limit (SIGTERM
    to its process group, as `timeout` sends) after its first run of two leaves a report of that
    run, marked partial, with its figures."""
    command = [sys.executable, REPO / "benchmarks" / "run.py", "--only", "fsdp2", "--fsdp2-steps",
               "2", "--fsdp2-world-sizes", "1", "--fsdp2-options", "plain", "--repeats", "2",
               "--smoke", "--out", tmp_path / "tables.md", "--raw-json", tmp_path / "runs.json"]
    proc = subprocess.Popen([str(c) for c in command], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "tables.md").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
    finally:
        output = proc.communicate(timeout=60)[0]
    assert proc.returncode != 0, output  # stopped before its second run ended
    markdown = (tmp_path / "tables.md").read_text()
    assert markdown.startswith("**Partial: 1 of 2 runs so far**"), markdown
    row = table_rows(markdown)[1]
    assert float(row["tokens/s"].replace(",", "")) > 0, row
    runs = json.loads((tmp_path / "runs.json").read_text())["runs"]
    assert len(runs) == 1 and runs[0]["figures"]["tokens_per_s"] == runs[0]["metrics"][
        "tokens_per_s"]


def test_memory_picture_is_drawn(tmp_path):
    pytest.importorskip("matplotlib")
    from t5_memory import draw

    sizes = [1, 2, 4]
    curves = [{"label": "full", "colour": "tab:blue", "linestyle": "-", "world_sizes": sizes,
               "train_state": [4e9 / n for n in sizes], "peak": [5e9 / n for n in sizes]},
              {"label": "LoRA", "colour": "tab:green", "linestyle": "--", "world_sizes": sizes,
               "train_state": [1e9 / n for n in sizes], "peak": [2e9 / n for n in sizes]}]
    measured = [{"label": "full", "colour": "tab:blue", "world_size": 2, "train_state": 2e9,
                 "peak": 4e9}]
    path = draw(tmp_path / "memory.png", "title", curves, measured, note="a note")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def dry_run_on_two_cpu_ranks(benchmark):
    """The commands of --only BENCHMARK --dry-run, each asserted to run 2 ranks on the CPU."""
    proc = subprocess.run([sys.executable, REPO / "benchmarks" / "run.py", "--only", benchmark,
                           "--dry-run"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    runs = [line for line in proc.stdout.splitlines() if "torch.distributed.run" in line]
    assert all("--nproc_per_node 2" in run and "--cpu" in run.split() for run in runs), runs
    return runs


def test_cpu_memory_benchmark_runs_what_it_says():
    """--only cpu-memory --dry-run: each of its six rows twice on 2 CPU ranks, once as the script
    runs by default and once with --return-freed-memory, the LoRA rows at t5-base's shape."""
    runs = dry_run_on_two_cpu_ranks("cpu-memory")
    assert len(runs) == 12
    returned = [run for run in runs if "--return-freed-memory" in run]
    assert [run.replace(" --return-freed-memory", "") for run in returned] == [
        run for run in runs if run not in returned]
    lora = [run for run in returned if "--lora-rank 16" in run]
    assert len(lora) == 2 and all("t5-base-shape" in run for run in lora)


def test_lengths_benchmark_runs_what_it_says():
    """--only lengths --dry-run: T5 at t5-base's shape with the tutorial's lengths, padded and with
    --max-tokens, on the fixture and on WikiHow-like lengths (two data folders); fsdp2 with its
    documents one per row and packed. Each pair differs in its way's flag alone."""
    runs = dry_run_on_two_cpu_ranks("lengths")
    assert len(runs) == 6
    t5 = [run for run in runs if "t5_fsdp_finetune.py" in run]
    assert len(t5) == 4 and all("t5-base-shape" in run and "--input-length 512" in run
                                for run in t5)
    assert [run.replace(" --max-tokens 1324", "") for run in t5[1::2]] == t5[0::2]
    assert len({run.split("--data-dir ")[1].split()[0] for run in t5}) == 2
    padded, packed = (run for run in runs if "fsdp2_transformer.py" in run)
    assert padded.replace(" --pad-documents", "") == packed and "--pack-documents" in packed


def test_fault_tolerance_benchmark_runs_what_it_says():
    """--only fault-tolerance --dry-run: the same training twice, as torchft's 2 replica groups of
    2 ranks started with python, and as HSDP on 4 ranks that torchrun restarts once (from the
    checkpoints saved every 10 steps)."""
    proc = subprocess.run([sys.executable, REPO / "benchmarks" / "run.py", "--only",
                           "fault-tolerance", "--dry-run"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    groups, restart = proc.stdout.splitlines()
    assert groups.split()[1].endswith("fsdp2_transformer.py")  # python SCRIPT: it starts them
    assert "--nproc_per_node 4 --max-restarts 1" in restart
    script = restart.split(" -m torch.distributed.run --standalone --nproc_per_node 4 "
                           "--max-restarts 1 ")[1]
    assert script.replace("--replicate-degree 2", "--fault-tolerance --world-size 2") in groups
    assert "--save-every 10 --cpu" in script and "--checkpoint-format sharded" in script


def test_profile_step_gives_a_steps_time_by_kind(tmp_path, still_t5_dir, wikihow_dir):
    """benchmarks/profile_step.py (the LoRA profile of benchmarks/README.md) runs the T5 script's
    units under torchrun and prints one JSON line from rank 0: a step's time, and per kind the
    profiled time and calls. FSDP1 LoRA's adapters, kept whole, add one all-reduce a step and no
    unit: under 50 collectives a step (22 with torch 2.14; 164 when each adapter was a unit)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               "2", REPO / "benchmarks" / "profile_step.py", still_t5_dir, wikihow_dir,
               "--fsdp-version", "1", "--lora-rank", "8", "--batch-size", "4", "--warmup", "1",
               "--steps", "2"]
    result = subprocess.run([str(c) for c in command], cwd=tmp_path, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    [line] = [line for line in result.stdout.splitlines() if line.startswith("{")]
    profile = json.loads(line)
    kinds = profile["kinds"]
    assert profile["step_ms"] > 0, profile
    assert {"communication", "FSDP's own Python", "matmuls"} <= set(kinds), kinds
    assert 0 < kinds["communication"]["calls"] < 50, kinds
