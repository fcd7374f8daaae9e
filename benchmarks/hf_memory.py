"""benchmarks/run.py --only hf-load: each rank's anonymous memory while a model loads.

rss_anon_peaks runs a torchrun launch and samples RssAnon (/proc/PID/status) of every rank until a
line appears in its output: anonymous memory only, not the page cache that memory-mapped
safetensors files show as resident. Run as a program, it stores a model in another dtype, once as
safetensors (save_pretrained) and once as a pytorch_model.bin (torch.save), the same tensors and
the same config and tokenizer files in both:

    python benchmarks/hf_memory.py MODEL_DIR bf16 SAFETENSORS_DIR BIN_DIR INFO_JSON
"""
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# glibc serves big allocations from its heap once big ones have been freed (its mmap threshold
# grows), and keeps freed heap memory: a measurement after training would see the export reuse
# training's freed memory, not what it needs. A fixed threshold maps every allocation of 64 KiB
# or more on its own and returns it on free, so RssAnon follows the live tensors.
RETURN_FREED = {"MALLOC_MMAP_THRESHOLD_": "65536"}
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
                "pytorch_model.bin.index.json")


def descendants(root):
    """The PIDs of root's children, their children, and so on (torchrun's workers are children
    of its agent)."""
    children = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        children.setdefault(parent, []).append(int(pid))
    found, todo = [], [root]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def rank_of(pid):
    """The RANK torchrun gave process pid (None: not a worker, or gone)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            ranks = [v for v in f.read().split(b"\0") if v.startswith(b"RANK=")]
    except OSError:
        return None
    return int(ranks[0][5:]) if ranks else None


def rss_anon(pid):
    """RssAnon of process pid in bytes (None: gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            kib = [int(line.split()[1]) for line in f if line.startswith("RssAnon:")]
    except (OSError, IndexError, ValueError):
        return None
    return kib[0] * 1024 if kib else None


def rss_anon_peaks(command, cwd, until, env=None, timeout=900, interval=0.01, rescan=0.25,
                   start=None, stop=False):
    """Run command (a torchrun launch) in cwd and sample every rank's RssAnon every interval
    seconds until its stdout has `until` in it (or it ends); then let it finish (stop: terminate
    it at once, the rest unmeasured). start: count only the samples taken once stdout has `start`
    in it, the first of them each rank's base (what the process held as the measured part began).
    Returns (returncode, stdout, stderr, {rank: peak bytes until then}, whether `until` was seen,
    {rank: base bytes}); after timeout seconds the launch is terminated (torchrun passes SIGTERM
    on to its workers). rss_anon_windows measures several parts of one run."""
    returncode, stdout, stderr, [(peaks, seen, bases)] = rss_anon_windows(
        command, cwd, [(start, until)], env=env, timeout=timeout, interval=interval,
        rescan=rescan, stop=stop)
    return returncode, stdout, stderr, peaks, seen, bases


def rss_anon_windows(command, cwd, windows, env=None, timeout=900, interval=0.01, rescan=0.25,
                     stop=False):
    """rss_anon_peaks for each window (start, until) of one run, start None for the run's start:
    a window counts the samples taken once stdout has its start and before it has its until.
    Sampling ends once every window's until has come (or the run has ended). Returns
    (returncode, stdout, stderr, [(peaks, whether until came, bases) per window]).
    The workers are looked for among the launch's descendants every rescan seconds (a scan reads
    every /proc/PID/stat); between scans only the known workers' status files are read."""
    cwd = Path(cwd)
    deadline = time.monotonic() + timeout
    measured = [({}, {}) for _ in windows]  # ({rank: peak}, {rank: base}) per window
    with open(cwd / "stdout.txt", "w") as out, open(cwd / "stderr.txt", "w") as err:
        launch = subprocess.Popen([str(part) for part in command], cwd=cwd, env=env, stdout=out,
                                  stderr=err)
        workers, scanned = {}, 0.0
        while launch.poll() is None and time.monotonic() < deadline:
            printed = (cwd / "stdout.txt").read_text(errors="replace")
            open_windows = [(start is None or start in printed) and until not in printed
                            for start, until in windows]
            if all(until in printed for _, until in windows):
                break
            if time.monotonic() - scanned > rescan:
                for pid in descendants(launch.pid):
                    if pid not in workers and (rank := rank_of(pid)) is not None:
                        workers[pid] = rank
                scanned = time.monotonic()
            for pid, rank in list(workers.items()):
                value = rss_anon(pid)
                if value is None:
                    del workers[pid]
                    continue
                for (peaks, bases), counting in zip(measured, open_windows):
                    if counting:
                        bases.setdefault(rank, value)
                        peaks[rank] = max(peaks.get(rank, 0), value)
            time.sleep(interval)
        if stop and launch.poll() is None:
            launch.terminate()
        try:
            launch.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            launch.terminate()
            try:
                launch.wait(timeout=60)
            except subprocess.TimeoutExpired:
                launch.kill()
                launch.wait()
    stdout, stderr = ((cwd / name).read_text(errors="replace")
                      for name in ("stdout.txt", "stderr.txt"))
    return launch.returncode, stdout, stderr, [
        (peaks, until in stdout, bases) for (peaks, bases), (_, until) in zip(measured, windows)]


def store(model_dir, dtype, safetensors_dir, bin_dir):
    """model_dir's model in dtype, as safetensors in safetensors_dir and as a pytorch_model.bin in
    bin_dir (each with model_dir's other files: config, tokenizer); returns its parameter count."""
    import torch
    from transformers import T5ForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    model = T5ForConditionalGeneration.from_pretrained(model_dir).to(dtypes[dtype])
    for folder in (safetensors_dir, bin_dir):
        shutil.copytree(model_dir, folder, ignore=shutil.ignore_patterns(*WEIGHT_FILES))
    model.save_pretrained(safetensors_dir)
    shutil.copy(Path(safetensors_dir) / "config.json", Path(bin_dir) / "config.json")
    torch.save(model.state_dict(), Path(bin_dir) / "pytorch_model.bin")
    return sum(p.numel() for p in model.parameters())


if __name__ == "__main__":
    if len(sys.argv) != 6:
        sys.exit(__doc__)
    source, dtype, safetensors_dir, bin_dir, info = sys.argv[1:]
    parameters = store(source, dtype, safetensors_dir, bin_dir)
    Path(info).write_text(json.dumps({"parameters": parameters, "dtype": dtype}))
