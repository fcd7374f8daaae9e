"""t5_fsdp_finetune.py --max-tokens: each rank's share of a step in micro-batches of at most N
tokens, each cut to its longest example, their gradients added up. On the dropout-free tiny T5,
with the WikiHow fixture's first 12 articles, whose lengths give one rank 1 micro-batch and the
other 3 in a step of each epoch: 2 ranks train and validate as one process does on the same global
batch padded to --input-length and --output-length (the tutorial's way), under FSDP1, FSDP2 and
with LoRA; and their checkpoint resumes on one process."""
import shutil
import sys

import pytest
from conftest import LORA, REPO, cached_t5_runs, warning_lines
from torch.utils.data.distributed import DistributedSampler

sys.path.insert(0, str(REPO))
from summarization_dataset import wikihow  # noqa: E402

SCRIPT = "t5_fsdp_finetune.py"
# 12 articles, 2 steps of 6 per epoch; --seed 12 shuffles them so that in the second step of each
# epoch one rank holds 3 short articles (1 micro-batch of at most 192 tokens) and the other 3
# long ones (3). 7 validation articles: DistributedSampler repeats one, which counts for nothing.
LENGTHS = ["--input-length", 128, "--output-length", 40, "--num-train-samples", 12,
           "--num-val-samples", 7, "--test-batch-size", 3, "--lr", 0.002, "--seed", 12,
           "--epochs", 2]
GLOBAL_BATCH, MAX_TOKENS = 6, 192
TOKENS = ["--max-tokens", MAX_TOKENS]


def token_args(still_t5_dir, wikihow_dir, ranks, *args):
    return ["--model-name", still_t5_dir, "--data-dir", wikihow_dir, *LENGTHS,
            "--batch-size", GLOBAL_BATCH // ranks, *args]


def micro_batch_counts(still_t5_dir, wikihow_dir, epoch, ranks=2):
    """Each step's micro-batches on each rank under --max-tokens, from the data, as --help defines
    them: a rank's examples, sorted by length (source + target tokens), added to a micro-batch
    while its examples x (longest source + longest target) stay within MAX_TOKENS."""
    from transformers import T5Tokenizer

    options = dict(zip(LENGTHS[::2], LENGTHS[1::2]))
    data = wikihow(T5Tokenizer.from_pretrained(still_t5_dir), "train",
                   options["--num-train-samples"], options["--input-length"],
                   options["--output-length"], data_dir=wikihow_dir)
    lengths = list(zip(data.source_mask.sum(1).tolist(), data.target_mask.sum(1).tolist()))
    counts = []
    for rank in range(ranks):
        sampler = DistributedSampler(data, num_replicas=ranks, rank=rank, shuffle=True,
                                     seed=options["--seed"])
        sampler.set_epoch(epoch)
        indices, batch = list(sampler), GLOBAL_BATCH // ranks
        counts.append([])
        for step in range(0, len(indices), batch):
            groups = []
            for i in sorted(indices[step:step + batch], key=lambda i: sum(lengths[i])):
                group = [*groups[-1], i] if groups else [i]
                longest = [max(side) for side in zip(*(lengths[j] for j in group))]
                if len(group) > 1 and len(group) * sum(longest) <= MAX_TOKENS:
                    groups[-1] = group
                else:
                    groups.append([i])
            counts[-1].append(len(groups))
    return list(zip(*counts))  # per step: (rank 0's, rank 1's)


@pytest.mark.parametrize("epoch", [1, 2])
def test_the_lengths_give_one_rank_1_micro_batch_and_the_other_3(still_t5_dir, wikihow_dir,
                                                                 epoch):
    assert micro_batch_counts(still_t5_dir, wikihow_dir, epoch)[1] in {(1, 3), (3, 1)}


@pytest.fixture(scope="session")
def token_run(cached_torchrun, still_t5_dir, wikihow_dir):
    """run(ranks, *args): a cached run of LENGTHS on `ranks` ranks; it must succeed."""
    return cached_t5_runs(cached_torchrun,
                          lambda ranks, *args: token_args(still_t5_dir, wikihow_dir, ranks, *args))


# name: (2 ranks' flags, with --max-tokens; one process's, padded); FSDP2 also recomputes each
# block's activations (activation checkpointing) in backward, of micro-batches of every shape
LAYOUTS = {"FSDP1": (["--checkpoint-type", "sharded"], ["--no-save-model"]),
           "FSDP2": (["--fsdp-version", 2, "--activation-checkpointing", "--no-save-model"],
                     ["--no-save-model"]),
           "LoRA, FSDP2": ([*LORA, "--fsdp-version", 2, "--no-save-model"],
                           [*LORA, "--no-save-model"])}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_token_budgets_on_2_ranks_train_as_one_padded_process(token_run, layout):
    """Every epoch's train and validation loss on 2 ranks, micro-batches of at most 192 tokens
    (1 on one rank, 3 on the other: fillers keep them in step), equals one process's on the same
    global batch padded to the lengths, within 1e-6; no warning."""
    tokens, padded = LAYOUTS[layout]
    run, one = token_run(2, *TOKENS, *tokens), token_run(1, *padded)
    for key in ("train_losses", "val_losses"):
        assert len(run.metrics[key]) == 2
        assert run.metrics[key] == pytest.approx(one.metrics[key], rel=1e-6, abs=0)
    assert warning_lines(run.output) == []


def test_a_token_budget_checkpoint_resumes_on_one_process(token_run, torchrun, still_t5_dir,
                                                          wikihow_dir, tmp_path):
    """FSDP1's epoch-1 checkpoint of 2 ranks under --max-tokens, resumed by one process (DCP
    reshards it), trains and validates epoch 2 as the 2 ranks did, within 1e-6."""
    run = token_run(2, *TOKENS, *LAYOUTS["FSDP1"][0])
    shutil.copytree(run.cwd / "checkpoint-epoch-1", tmp_path / "ckpt" / "checkpoint-epoch-1")
    resumed = torchrun(SCRIPT, *token_args(still_t5_dir, wikihow_dir, 1, *TOKENS,
                                           *LAYOUTS["FSDP1"][0], "--resume", "auto",
                                           "--save-dir", "ckpt"), nproc=1)
    assert resumed.returncode == 0, resumed.output
    assert "Resumed from" in resumed.stdout
    for key in ("train_losses", "val_losses"):
        assert resumed.metrics[key] == pytest.approx(run.metrics[key], rel=1e-6, abs=0)
