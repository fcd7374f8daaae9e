"""The run's report: its time (on a GPU with CUDA events too), each rank's memory and training
state, printed and written to --metrics-json; and the progress bar of a loop."""
import json
import os
import resource
import sys
import time

import torch
import torch.distributed as dist
from tqdm import tqdm

from .errors import rank0_print

RUN = {"script": None}  # the file of the script whose main runs here (launch sets it)


def tensors_in(state, local=True):
    """Every tensor in a (nested) state dict, list or tuple; of a DTensor, its local shard (local)
    or itself, whose size is the whole tensor's."""
    values = state.values() if isinstance(state, dict) else state
    for value in values if isinstance(state, (dict, list, tuple)) else [state]:
        if isinstance(value, (dict, list, tuple)):
            yield from tensors_in(value, local)
        elif torch.is_tensor(value):
            yield value.to_local() if local and hasattr(value, "to_local") else value


def nbytes(tensors):
    """The bytes of the tensors' elements."""
    return sum(t.numel() * t.element_size() for t in tensors)


class Report:
    """Times the run, measures memory per rank, prints both and writes --metrics-json: the
    figures of every script, plus the script's own (write())."""

    def __init__(self, metrics_json, device):
        self.metrics_json, self.device = metrics_json, device
        self.cuda = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        self.cuda = self.cuda if device.type == "cuda" else None
        self.restart()

    def restart(self):
        """Time the run from now on (what came before, such as loading, left out)."""
        self.start, self.laps = time.perf_counter(), []
        if self.cuda:
            self.cuda[0].record()

    def lap(self):
        """Seconds since the previous lap, or since the start; self.laps keeps them all."""
        self.laps.append(time.perf_counter() - self.start - sum(self.laps))
        return self.laps[-1]

    def memory(self, model, optimizer=None):
        """(train state, peak) bytes, the maximum over ranks: parameters + gradients + optimizer
        state (shards under FSDP, replicas under DDP); CUDA max allocated, or the peak RSS."""
        state = [[t for t in (p, p.grad) if t is not None] for p in model.parameters()]
        state.append(list(optimizer.state.values()) if optimizer else [])
        peak = (torch.cuda.max_memory_allocated(self.device) if self.cuda
                else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # KiB on Linux
        figures = torch.tensor([nbytes(tensors_in(state)), peak], dtype=torch.float64,
                               device=self.device)
        ranks = [torch.zeros_like(figures) for _ in range(dist.get_world_size())]
        dist.all_gather(ranks, figures)
        self.peaks = [int(rank[1]) for rank in ranks]  # per rank, for --metrics-json
        return int(max(rank[0] for rank in ranks)), max(self.peaks)

    def training_done(self, model, optimizer, trained=True):
        """Print the training time (not when nothing was left to train) and the memory figures."""
        self.wall_s = time.perf_counter() - self.start
        if trained and self.cuda:
            self.cuda[1].record()
            self.cuda[1].synchronize()
            seconds = self.cuda[0].elapsed_time(self.cuda[1]) / 1000
            rank0_print(f"CUDA event elapsed time: {seconds:.3f}sec")
        elif trained:
            rank0_print(f"Wall-clock elapsed time: {self.wall_s:.3f}sec")
        self.state, self.peak = self.memory(model, optimizer)
        rank0_print(f"Peak memory per rank ({'CUDA allocated' if self.cuda else 'process RSS'}): "
                    f"{self.peak / 2**20:.1f} MiB; parameters + gradients + optimizer state: "
                    f"{self.state / 2**20:.3f} MiB")

    def write(self, **metrics):
        """Rank 0 writes --metrics-json, under a temporary name first: never half-written."""
        if self.metrics_json and dist.get_rank() == 0:
            metrics = {"script": RUN["script"], "world_size": dist.get_world_size(),
                       "device": self.device.type, "backend": dist.get_backend(), "wall_s":
                       self.wall_s, "train_state_bytes": self.state, "peak_memory_bytes":
                       self.peak, "peak_memory_per_rank": self.peaks, **metrics}
            write_json(self.metrics_json, metrics)


def write_json(path, value):
    """Write value to path as JSON, under a temporary name first: never half-written."""
    with open(f"{path}.tmp", "w") as f:
        json.dump(value, f, indent=2)
    os.replace(f"{path}.tmp", path)


def progress_bar(batches, desc, colour, disable, total):
    """A loop's progress on rank 0: tqdm's bar (live, coloured, cleared at the end) on a terminal;
    one line, the bar's final state, when stderr is a file or a pipe (a log: no redraws, no
    colour codes)."""
    if sys.stderr.isatty():
        return tqdm(batches, desc=desc, colour=colour, leave=False, disable=disable, total=total)
    return FinalLine(batches, desc=desc, disable=disable, total=total)


class FinalLine(tqdm):
    """A tqdm bar that writes one line, its final state, when its loop ends."""

    class Discard:
        def write(self, text):
            pass

        def flush(self):
            pass

    def __init__(self, iterable, desc, disable, total):
        super().__init__(iterable, desc=desc, disable=disable, total=total, file=self.Discard())

    def close(self):
        if not self.disable:
            print(self, file=sys.stderr, flush=True)
        super().close()
