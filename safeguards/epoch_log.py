"""t5_fsdp_finetune.py's log: the run's Report (time, memory, --metrics-json) with the lines of
an epoch's training, validation and summaries, and progress bars whose batches keep the ranks in
step (LockStep)."""
import importlib
import json
import os

import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

from .describe import compiled_graphs
from .errors import PROGRESS, LockStep, rank0_print
from .report import Report, progress_bar


class EpochLog(Report):
    """The run's Report with t5_fsdp_finetune.py's lines: each rank's memory once loaded, each
    epoch's time (training alone, then with validation) and, with track_memory, peak memory; at
    the end samples/s and the summary. Its bar is train's and validation's progress bar, which
    keeps the ranks in step (LockStep; with max_tokens, in each forward too)."""

    def __init__(self, metrics_json, device, *, save_dir, rouge, compile, track_memory,
                 dist_timeout, max_tokens):
        super().__init__(metrics_json, device)
        self.save_dir, self.rouge, self.compile = os.path.abspath(save_dir), rouge, compile
        self.track_memory, self.dist_timeout, self.max_tokens = (track_memory, dist_timeout,
                                                                 max_tokens)

    def begin(self, model, train_loader, val_loader):
        """Print the sizes of the data and each rank's peak memory so far: what loading and
        wrapping the model cost it. Returns the log."""
        self.train_loader, self.val_loader = train_loader, val_loader
        self.train_times, self.epoch_times, self.generated, self.graphs = [], [], [], []
        if self.rouge:  # nltk (2 s, with scipy) imported now, not in epoch 1's ROUGE time
            importlib.import_module("rouge_score.rouge_scorer")
        # bar's: ranks kept in step; with --max-tokens also in each step's forwards (a rank's count
        # varies there), which costs a check-in each.
        self.lock_step = LockStep(self.dist_timeout,
                                  model=model if self.max_tokens else None)
        rank0_print(f"Size of train dataset: {len(train_loader.dataset)}, validation dataset: "
                    f"{len(val_loader.dataset) if val_loader else 'none (--no-run-validation)'}")
        self.memory(model)
        self.loaded = self.peaks  # for --metrics-json
        rank0_print("Peak memory per rank after loading the model: "
                    + ", ".join(f"{peak / 2**20:.1f}" for peak in self.peaks) + " MiB")
        return self

    def trained(self):
        self.train_times.append(self.lap())

    def epoch_done(self, epoch, model, optimizer):
        self.epoch_times.append(self.train_times[-1] + self.lap())
        rank0_print(f"Epoch {epoch} time: {self.epoch_times[-1]:.2f}s")
        if self.compile:  # those of the first epoch (training, validation); later, none
            self.graphs.append(compiled_graphs() - sum(self.graphs))
            rank0_print(f"Graphs compiled in epoch {epoch}: {self.graphs[-1]}"
                        + (" (a recompile: a new shape or mode)" if epoch > 1 and self.graphs[-1]
                           else ""))
        if self.track_memory:
            kind = "CUDA allocated" if self.device.type == "cuda" else "process RSS"
            rank0_print(f"Peak memory per rank ({kind}): "
                        f"{self.memory(model, optimizer)[1] / 2**20:.1f} MiB")

    def summaries(self, epoch, summaries, rouge, references, run_name):
        """After generate_summaries and rouge_scores: their time and the scores, three articles
        with their summaries; rank 0 writes every one (title, article, reference, generated) to
        <--save-dir>/<run_name>-<epoch>-predictions.jsonl, under a temporary name first."""
        seconds, articles = self.lap(), self.val_loader.dataset.articles
        rank0_print("ROUGE-1 {rouge1:.2f}, ROUGE-2 {rouge2:.2f}, ROUGE-L {rougeL:.2f}, ROUGE-Lsum "
                    "{rougeLsum:.2f}".format(**rouge) + f" ({len(summaries)} summaries generated "
                    f"in {seconds:.2f}s: {seconds / len(summaries):.3f}s each)")
        for (title, text, _), reference, summary in zip(articles[:3], references, summaries):
            rank0_print(f"  {title}: {text[:120]}...\n    reference: {reference}\n"
                        f"    generated: {summary}")
        path = os.path.join(self.save_dir,
                            f"{run_name}-{epoch}-predictions.jsonl")
        self.generated.append({"epoch": epoch, **rouge, "seconds": seconds, "predictions": path,
                               "seconds_per_summary": seconds / len(summaries)})
        if dist.get_rank() == 0:
            with open(f"{path}.tmp", "w", encoding="utf-8") as f:
                for (title, text, _), reference, summary in zip(articles, references, summaries):
                    f.write(json.dumps({"title": title, "article": text, "reference": reference,
                                        "generated": summary}) + "\n")
            os.replace(f"{path}.tmp", path)
        self.lap()  # the file's time: not the next epoch's

    def epochs(self, numbers):
        """The epochs' numbers, timed from the first (not the loading and resuming before it),
        each without the saves after its validation."""
        self.restart()
        for number in numbers:
            yield number
            self.lap()  # the saves' time, not the next epoch's

    def done(self, model, optimizer, checkpointer, mixed_precision, sharding_strategy):
        """samples/s, time and memory, and --metrics-json, with what the run chose (its precision,
        strategy) and the trainer state."""
        train_loader, val_loader = self.train_loader, self.val_loader
        samples = len(train_loader.sampler) * dist.get_world_size() * len(self.train_times)
        samples_per_s = samples / sum(self.train_times)
        rank0_print(f"Training: {samples_per_s:.1f} samples/s")
        self.training_done(model, optimizer)
        state, best = checkpointer.state, checkpointer.state["best_checkpoint"]
        self.write(
            train_loss=state["train_losses"][-1], train_losses=state["train_losses"],
            val_loss=state["best_val_loss"], val_losses=state["val_losses"],
            epoch_times=self.epoch_times, samples_per_s=samples_per_s,
            train_batches=len(train_loader), val_batches=len(val_loader or ()),
            peak_memory_after_loading_per_rank=self.loaded,
            checkpoint=f"{best}-hf" if best else None,
            checkpoint_pt=f"{best}.pt" if best and checkpointer.full_state_dict else None,
            adapter=f"{best}-adapter" if best and state["lora"] else None, lora=state["lora"],
            mixed_precision=mixed_precision, fsdp_version=1 if isinstance(model, FSDP) else 2,
            rouge=self.generated[-1] if self.generated else None, rouge_per_epoch=self.generated,
            best_rouge=state.get("best_rouge"), compiled_graphs_per_epoch=self.graphs,
            sharding_strategy=(model.sharding_strategy.name if isinstance(model, FSDP)
                               else sharding_strategy))

    def bar(self, loader, desc, colour, leave, disable):
        """train's and validation's bar (progress_bar; tqdm's interface), whose batches come
        through LockStep: ranks that get out of step stop in one line."""
        what = desc.removeprefix("r0 ")
        PROGRESS["at"] = f" in {what}"  # for the line of an interrupted run
        batches = self.lock_step.batches(loader, what.lower())
        return progress_bar(batches, desc=desc, colour=colour, disable=disable, total=len(loader))
