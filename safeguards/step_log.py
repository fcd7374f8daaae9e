"""fsdp2_transformer.py's step log: each step's loss read from the device one step late (the host
never waits for the GPU), a line every --log-every steps with tokens/s (on a GPU also TFLOP/s and
MFU), and the steady state's summary, memory and --metrics-json at the end."""
import math
import statistics
import time

import torch
import torch.distributed as dist

from .errors import PROGRESS, diverged, fail, rank0_print
from .fsdp2_saves import checkpoint_figures


class StepLog:
    """Each step's loss and gradient norm, read from the device one step late, so that the host
    never makes the GPU wait (the loss of the newest step is read only on a line or before a
    save). Every --log-every steps a line gives the loss and, for the steps since the line before,
    tokens/s (on a GPU also TFLOP/s and MFU). A non-finite loss stops every rank. done() prints
    the steady state, the first warmup steps and checkpoint pauses excluded, and the metrics;
    with packed documents also useful tokens/s: the tokens of documents, not of the padding."""

    def __init__(self, report, model, steps, log_every, tokens_per_step, bf16, warmup, advice):
        """steps: the range of steps this run trains; advice: what to try if it diverges."""
        self.report, self.log_every, self.warmup = report, log_every, warmup
        self.advice = advice
        self.first, self.last_step = steps.start, steps.stop - 1
        self.tokens_per_step = tokens_per_step
        self.flops_per_token = flops_per_token(model, model.pos_embeddings.num_embeddings)
        self.peak_tflops = peak_tflops(report.device, bf16)
        self.unread, self.losses, self.grad_norms, self.seconds = [], [], [], []
        self.useful = []  # packed documents: each step's (document tokens, tokens) on this rank
        self.last_line = 0  # len(self.seconds) when the last line was printed
        if not steps:
            rank0_print(f"The checkpoint is at step {self.first - 1}, --steps is "
                        f"{self.last_step}: no training")
        self.clock = time.perf_counter()

    def step(self, step, loss, grad_norm, batch, check_now=False):
        """batch: this rank's rows, on the host (packed_batch's: their padding is counted)."""
        PROGRESS["at"] = f" at step {step}"  # for the line of an interrupted run
        if batch.dim() == 3:  # (tokens, labels, positions, document ids); the padding's is -1
            self.useful.append((int((batch[:, 3] >= 0).sum()), batch[:, 3].numel()))
        self.unread.append((step, loss, grad_norm))
        line = step % self.log_every == 0 or step in (self.first, self.last_step)
        self.read(keep=0 if line or check_now else 1)
        now = time.perf_counter()
        self.seconds.append(now - self.clock)  # since the step before: the data wait included
        self.clock = now
        if line:
            rate = self.tokens_per_s(self.seconds[self.last_line:])
            rank0_print(f"step {step} | loss {self.losses[-1]:.4f} | grad norm "
                        f"{self.grad_norms[-1]:.3f} | tokens/s {rate:,.0f}" + self.flops(rate))
            self.last_line = len(self.seconds)

    def read(self, keep):
        while len(self.unread) > keep:
            step, loss, grad_norm = self.unread.pop(0)
            loss = loss.item() / dist.get_world_size()  # the same on every rank: it is reduced
            if not math.isfinite(loss):
                fail(diverged(f"the loss of step {step} is {loss}", self.advice))
            self.losses.append(loss)
            self.grad_norms.append(grad_norm.item())

    def useful_share(self, warmup):
        """Packed documents: the share of the steady steps' tokens (every rank's) that are in a
        document, not padding; else None. Every rank calls it (an all-reduce)."""
        if not self.useful:
            return None
        counts = torch.tensor(self.useful[max(warmup, 0):] or self.useful, dtype=torch.float64)
        counts = counts.sum(dim=0).to(self.report.device)
        dist.all_reduce(counts)  # (tensor parallel: each row counted T times, in both)
        return (counts[0] / counts[1]).item()

    def paused(self):
        """A checkpoint paused training until now: not training time."""
        self.clock = time.perf_counter()

    def tokens_per_s(self, seconds):
        return self.tokens_per_step * len(seconds) / sum(seconds) if seconds else None

    def flops(self, tokens_per_s):
        """TFLOP/s per GPU and MFU (model FLOPs utilization) at tokens_per_s, for a log line."""
        if self.report.device.type != "cuda":
            return ""
        tflops = self.flops_per_token * tokens_per_s / dist.get_world_size() / 1e12
        return f" | {tflops:.1f} TFLOP/s" + (
            f" | MFU {tflops / self.peak_tflops:.1%}" if self.peak_tflops else "")

    def done(self, model, optimizer, saves):
        """The summary of the steady state, memory, and --metrics-json."""
        self.read(keep=0)
        warmup = min(self.warmup, len(self.seconds) - 1)  # at least one step counts
        steady = self.seconds[max(warmup, 0):]
        step_time = statistics.median(steady) if steady else None
        tokens_per_s = self.tokens_per_step / step_time if step_time else None
        per_process = self.flops_per_token * (tokens_per_s or 0) / dist.get_world_size()
        figures = {"flops_per_token": self.flops_per_token, "gflops_per_s": per_process / 1e9,
                   "tflops_per_gpu": None, "mfu": None}
        if self.report.device.type == "cuda":
            figures["tflops_per_gpu"] = per_process / 1e12
            figures["mfu"] = self.peak_tflops and per_process / 1e12 / self.peak_tflops
        useful = self.useful_share(warmup)
        figures["useful_tokens_per_s"] = useful * tokens_per_s if useful and tokens_per_s else None
        if self.losses:
            vocab = model.output.out_features
            rank0_print(f"Trained steps {self.first}-{self.last_step}: final loss "
                        f"{self.losses[-1]:.4f} (ln(vocab) = {math.log(vocab):.4f}"
                        f"), {tokens_per_s:,.0f} tokens/s in the steady state" + (
                            f", {figures['useful_tokens_per_s']:,.0f} of them useful ({useful:.1%} "
                            "in documents, not padding)" if useful else "") + " (median step "
                        f"{step_time * 1000:.1f} ms, the first {max(warmup, 0)} step(s) and "
                        "checkpoint pauses left out), " + (
                            f"{figures['tflops_per_gpu']:.1f} TFLOP/s per GPU" + (
                                f", MFU {figures['mfu']:.1%}" if figures["mfu"] else "")
                            if figures["tflops_per_gpu"] is not None else
                            f"{figures['gflops_per_s']:,.1f} GFLOP/s per process"))
        self.report.training_done(model, optimizer, trained=bool(self.losses))
        saves = checkpoint_figures(saves)
        pauses = saves["checkpoint_stall_s"]
        if pauses:
            rank0_print(f"Checkpoints paused training {pauses[0]:.2f} s at the first save" + (
                f", a median {statistics.median(pauses[1:]):.2f} s at the {len(pauses) - 1} "
                "later ones" if len(pauses) > 1 else ""))
        self.report.write(
            train_loss=self.losses[-1] if self.losses else None, losses=self.losses,
            grad_norms=self.grad_norms, first_step=self.first,
            step=max(self.first - 1, self.last_step), tokens_per_s=tokens_per_s,
            step_time_s=step_time, warmup_steps=max(warmup, 0), step_times_s=self.seconds,
            **saves, **figures)


# Dense peak TFLOP/s of one GPU in (bf16, fp32), from NVIDIA's data sheets: the first name found
# in torch.cuda.get_device_name() counts. Other GPUs get no MFU.
PEAK_TFLOPS = {"H100 PCIe": (756, 51), "H100": (989, 67), "H200": (989, 67), "A100": (312, 19.5),
               "L40S": (362, 91.6), "L4": (121, 30.3)}


def peak_tflops(device, bf16):
    """This GPU's dense peak TFLOP/s in bf16 (or fp32), or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((p for gpu, p in PEAK_TFLOPS.items() if gpu in name), None)
    return peak and peak[0 if bf16 else 1]


def flops_per_token(model, seq_len):
    """Model FLOPs of one trained token, as torchtitan counts them: 6 per parameter outside the
    embeddings (the matmuls of forward and backward) plus 12 x layers x dim x seq_len for the
    attention scores and values. Recomputation (activation checkpointing) does not count."""
    embeddings = model.tok_embeddings.weight.numel() + model.pos_embeddings.weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embeddings  # DTensors: global sizes
    return 6 * params + 12 * len(model.layers) * model.norm.weight.numel() * seq_len
