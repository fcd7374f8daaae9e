"""safeguards.errors.LockStep: ranks that run different numbers of batches, or of forwards in a
batch, stop in one line instead of waiting in FSDP's collectives until --dist-timeout. The faults
are put into copies of the real scripts, run on 2 CPU ranks: a user's own loader that gives one
rank fewer batches (fsdp2), and T5's --max-tokens without the fillers that keep the ranks'
micro-batches in step."""
import shutil
import time

from conftest import (
    FSDP2_TINY,
    REPO,
    TORCHRUN,
    run_command,
    script_with_lines,
    single_error_line,
)
from test_token_batches import TOKENS, micro_batch_counts, token_args

# Far longer than any test here: a run that hangs until it would fail the test's own timeout.
TIMEOUT = ["--dist-timeout", 600]


def run_copy(script, tmp_path, args, timeout=240):
    """The patched copy in tmp_path on 2 ranks; the Run and its seconds."""
    started = time.monotonic()
    command = [*TORCHRUN, "--standalone", "--nproc_per_node", 2, script, *args, *TIMEOUT]
    run = run_command(command, tmp_path, timeout)
    return run, time.monotonic() - started


def test_an_fsdp2_rank_with_fewer_steps_stops_every_rank_in_one_line(tmp_path):
    """Rank 1's loader holds one step fewer: it runs out after step 5, rank 0 goes on to 6.
    Without LockStep, gloo aborts the run ("Fatal Python error: Aborted") on the mismatched
    collectives that follow: no line says why."""
    steps = "range(start_step + 1, args.steps + 1"
    script = script_with_lines("fsdp2_transformer.py", tmp_path, after=f"    steps = {steps})\n",
                               lines=f"    loader_steps = {steps} - rank)  # rank 1: one fewer\n")
    script.write_text(script.read_text().replace("DataLoader(steps,", "DataLoader(loader_steps,"))
    run, seconds = run_copy(script, tmp_path, [*FSDP2_TINY, "--steps", 6])
    assert run.returncode != 0
    line = single_error_line(run)
    assert ("ranks out of step: rank 0 went on to training batch 6; rank 1 ran out of training "
            "batches after batch 5") in line, line
    assert seconds < 120, seconds


def test_t5_without_its_filler_micro_batches_stops_in_one_line(tmp_path, still_t5_dir,
                                                               wikihow_dir):
    """--max-tokens with the filler line of micro_batches removed: the ranks cut the steps of epoch
    1 into different numbers of micro-batches (3 and 2 in the first, 1 and 3 in the second:
    test_token_batches.py). The rank with fewer goes on to the optimizer step while the other
    runs its next forward; without LockStep both wait in a collective until --dist-timeout."""
    filler = "    batches += [filler] * (count.item() - len(batches))\n"
    script = script_with_lines("t5_fsdp_finetune.py", tmp_path, after="import os\n", lines="")
    assert filler in script.read_text()
    script.write_text(script.read_text().replace(filler, ""))
    shutil.copy(REPO / "summarization_dataset.py", tmp_path)
    step, counts = next((step, counts) for step, counts in enumerate(
        micro_batch_counts(still_t5_dir, wikihow_dir, 1), start=1) if len(set(counts)) > 1)
    run, seconds = run_copy(script, tmp_path, token_args(still_t5_dir, wikihow_dir, 2, *TOKENS,
                                                         "--no-save-model"))
    assert run.returncode != 0
    line = single_error_line(run)
    fewer = min(counts)
    said = [f"went on to the optimizer step after {fewer} forward(s) of training epoch 1 batch "
            f"{step}" if count == fewer else f"ran forward {fewer + 1} of training epoch 1 batch "
            f"{step}" for count in counts]
    assert f"ranks out of step: rank 0 {said[0]}; rank 1 {said[1]}" in line, line
    assert seconds < 120, seconds
