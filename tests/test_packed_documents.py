"""fsdp2_transformer.py --pack-documents: documents of varied lengths packed into --seq-len rows.
In process (the lesson's units, one process, no process group): a packed batch's loss and
gradients are those of its documents run one by one, and a document's tokens reach no other
document's logits. Run for real on CPU (gloo): tensor parallel with activation checkpointing and
gradient accumulation gives the losses of 1-D FSDP, and a sharded checkpoint of 2 ranks resumes on
1 with the same losses."""
import shutil
import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import FSDP2_TINY, REPO, queue_cached_run, warning_lines

sys.path.insert(0, str(REPO))
from fsdp2_transformer import Transformer, packed_batch, task_rules  # noqa: E402

SCRIPT = "fsdp2_transformer.py"
CONFIG = {"vocab_size": 64, "dim": 32, "n_layers": 3, "n_heads": 4, "seq_len": 16}  # TINY's sizes
PACKED = [*FSDP2_TINY, "--steps", 20, "--pack-documents"]
# 1-D FSDP on 2 ranks, sharded checkpoints at steps 10 and 20; and (dp 1, tp 2) on 2 ranks with
# activation checkpointing and 2 micro-batches per step
ONE_D = ["--checkpoint-dir", "ckpt", "--checkpoint-format", "sharded", "--save-every", 10]
TWO_D = ["--tp-degree", 2, "--activation-checkpointing", "--grad-accum-steps", 2]


def start_early(request):
    """Queue this file's two 2-rank runs as the session starts, at the lowest priority (conftest):
    its tests, which run last, wait for them."""
    if any(item.module is sys.modules[__name__] for item in request.session.items
           if getattr(item, "module", None) is not None and "packed_run" in item.fixturenames):
        for options in (ONE_D, TWO_D):
            queue_cached_run(request, SCRIPT, *PACKED, *options)


@pytest.fixture(scope="session")
def packed_run(cached_torchrun):
    def run(*options, nproc=2):
        result = cached_torchrun(SCRIPT, *PACKED, *options, nproc=nproc)
        assert result.returncode == 0, result.output
        return result

    return run


def documents_of(rows):
    """[(row, start, end)] of each document in packed_batch's rows (the padding's id is -1)."""
    found = []
    for row, ids in enumerate(rows[:, 3].tolist()):
        for doc in dict.fromkeys(i for i in ids if i >= 0):
            positions = [t for t, i in enumerate(ids) if i == doc]
            found.append((row, positions[0], positions[-1] + 1))
    return found


def test_a_packed_batch_is_its_documents_one_by_one():
    """Rows of documents that follow the task's rules, positions restarting in each, no label
    across a document's end or in the padding; the packed loss (mean over real tokens) and its
    gradients equal those of the documents run one by one, each alone in a row, within 1e-5.
    --pad-documents puts the same lengths one per row: most of its tokens are padding."""
    rules = task_rules(64, 0)
    rows = packed_batch(rules, 3, 8, 16, 0)
    tokens, labels, positions, ids = rows.unbind(1)
    documents = documents_of(rows)
    assert len(documents) > 2 * len(rows) and (ids < 0).any()  # packed, and padded at row ends
    for row, start, end in documents:
        doc = tokens[row, start:end]
        assert positions[row, start:end].tolist() == list(range(end - start))
        assert labels[row, start:end].tolist() == [*doc[1:].tolist(), -100]
        assert (rules[:, doc[:-1]] == doc[1:]).all(dim=1).any()  # one rule throughout
    assert (labels[ids < 0] == -100).all()
    padded = packed_batch(rules, 3, 8, 16, 0, one_per_row=True)
    assert len(documents_of(padded)) == 8 and (padded[:, 3] >= 0).sum() < (ids >= 0).sum() / 2

    torch.manual_seed(0)
    model = Transformer(**CONFIG)
    logits = model(tokens, positions, ids)
    real = (labels != -100).sum()
    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum") / real
    packed_grads = torch.autograd.grad(loss, list(model.parameters()))
    one_by_one = sum(
        F.cross_entropy(model(tokens[row:row + 1, start:end])[0], labels[row, start:end],
                        reduction="sum") for row, start, end in documents) / real
    grads = torch.autograd.grad(one_by_one, list(model.parameters()))
    assert loss.item() == pytest.approx(one_by_one.item(), rel=1e-5)
    for (name, _), packed_grad, grad in zip(model.named_parameters(), packed_grads, grads):
        assert torch.allclose(packed_grad, grad, rtol=1e-5, atol=1e-6), name


def test_a_document_changes_no_other_documents_logits():
    """Changing the tokens of one document in the middle of a row changes its own later logits
    and not one bit of any other document's, before or after it in the row."""
    rows = packed_batch(task_rules(64, 0), 3, 8, 16, 0)
    row, start, end = next(doc for doc in documents_of(rows)
                           if doc[1] > 0 and doc[2] < 16 and rows[doc[0], 3, doc[2]] >= 0)
    tokens, _, positions, ids = rows.unbind(1)
    changed = tokens.clone()
    changed[row, start:end] = (changed[row, start:end] + 1) % 64
    torch.manual_seed(0)
    model = Transformer(**CONFIG)
    with torch.no_grad():
        before, after = model(tokens, positions, ids), model(changed, positions, ids)
    inside = torch.zeros(tokens.shape, dtype=torch.bool)
    inside[row, start:end] = True
    assert torch.equal(before[~inside], after[~inside])
    assert not torch.allclose(before[inside], after[inside])


def test_packed_documents_train_alike_in_every_layout(packed_run, tmp_path):
    """Packed, 20 steps: (dp 1, tp 2) with activation checkpointing and gradient accumulation has
    the losses of 1-D FSDP on 2 ranks within 1e-5; the 1-D run's sharded checkpoint of step 10
    resumes on 1 rank with its losses; the loss falls; useful tokens/s (not padding) is reported;
    no warning."""
    one_d, two_d = packed_run(*ONE_D), packed_run(*TWO_D)
    assert "tensor parallel over 2 ranks" in two_d.stdout
    assert two_d.metrics["losses"] == pytest.approx(one_d.metrics["losses"], rel=1e-5)
    assert two_d.metrics["grad_norms"][0] == pytest.approx(one_d.metrics["grad_norms"][0],
                                                           rel=1e-5)
    folder = tmp_path / "ckpt"
    shutil.copytree(one_d.cwd / "ckpt" / "step_000010", folder / "step_000010")
    resumed = packed_run("--checkpoint-dir", folder, "--checkpoint-format", "sharded", nproc=1)
    assert f"Resumed from {folder / 'step_000010'} at step 10" in resumed.stdout
    assert resumed.metrics["losses"] == pytest.approx(one_d.metrics["losses"][10:], rel=1e-5)
    losses = one_d.metrics["losses"]
    assert max(losses[-5:]) < min(losses[:5])
    metrics = one_d.metrics
    assert 0.5 * metrics["tokens_per_s"] < metrics["useful_tokens_per_s"] < metrics["tokens_per_s"]
    summary = next(line for line in one_d.stdout.splitlines() if line.startswith("Trained"))
    assert f"{metrics['useful_tokens_per_s']:,.0f} of them useful" in summary
    for run in (one_d, two_d, resumed):
        assert warning_lines(run.output) == []
