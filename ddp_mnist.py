"""DDP (DistributedDataParallel) training of the MNIST CNN, on GPUs or on CPU.

The baseline of fsdp1_mnist.py: the same program, every rank holding a full replica of the model,
its gradients and optimizer state (compare the two scripts' --metrics-json: train_state_bytes, peak
memory, time). The DDP part is wrap_model(); main() is the recipe. After the PyTorch tutorial
"Getting Started with FSDP", which compares FSDP with DDP on this model.

    python ddp_mnist.py                                # one process per GPU, or 2 CPU processes
    python ddp_mnist.py --cpu --world-size 4 --epochs 1
    torchrun --nproc_per_node 4 ddp_mnist.py
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        ddp_mnist.py

MNIST downloads into --data-dir (default data); offline, `python tests/digits_mnist.py data`
writes scikit-learn's digits as MNIST files. CUDA + NCCL when a GPU is visible, else CPU + gloo.
Copy it with the safeguards package: the launching, checks and one-line errors main applies.
"""
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.nn.parallel import DistributedDataParallel
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

from safeguards.checkpoints import check_outputs, saving
from safeguards.errors import agree_on_error, stop_if_diverged, stop_on_non_finite_gradients
from safeguards.flags import RankZeroArgumentParser, add_run_flags, positive
from safeguards.launch import launch
from safeguards.mnist_checks import DIVERGED, MEMORY_ADVICE, checked_mnist, flag_problem
from safeguards.report import Report, nbytes, tensors_in
from safeguards.workarounds import quiet_known_warnings


def rank0_print(*args, **kwargs):
    """print on rank 0 only: the one helper of the lesson's pieces."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs, flush=True)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, 1)
        self.conv2 = nn.Conv2d(32, 64, 3, 1)
        self.dropout1 = nn.Dropout(0.25)
        self.dropout2 = nn.Dropout(0.5)
        self.fc1 = nn.Linear(9216, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.conv2(x))
        x = F.max_pool2d(x, 2)
        x = torch.flatten(self.dropout1(x), 1)
        x = self.dropout2(F.relu(self.fc1(x)))
        return F.log_softmax(self.fc2(x), dim=1)


# ------------------------------------------------------------------------------------------ data
def load_mnist(data_dir):
    """MNIST's train and test sets, normalized as in the tutorial, downloaded if missing."""
    normalize = transforms.Compose([transforms.ToTensor(),
                                    transforms.Normalize((0.1307,), (0.3081,))])
    return [datasets.MNIST(data_dir, train=train, download=True, transform=normalize)
            for train in (True, False)]


# ------------------------------------------------------------------------------------------- DDP
def wrap_model(model, device):
    """DDP: every rank holds a full replica of the model, its gradients and optimizer state, and
    the gradients are all-reduced in backward. DDP also broadcasts rank 0's initial weights."""
    device_ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model.to(device), device_ids=device_ids)


# ------------------------------------------------------------------------------------------ step
def train(model, device, loader, optimizer, epoch, dry_run):
    model.train()
    loader.sampler.set_epoch(epoch)
    totals = torch.zeros(2, device=device)  # summed loss, samples
    for data, target in loader:
        data, target = data.to(device), target.to(device)
        optimizer.zero_grad()
        loss = F.nll_loss(model(data), target, reduction="sum")
        loss.backward()
        optimizer.step()
        totals += torch.stack([loss.detach(), torch.tensor(len(data), device=device)])
        if dry_run:
            break
    dist.all_reduce(totals)
    rank0_print(f"Train Epoch: {epoch} \tLoss: {totals[0] / totals[1]:.6f}")
    return (totals[0] / totals[1]).item()


def test(model, device, loader, dry_run):
    model.eval()
    sampler, seen = loader.sampler, 0
    totals = torch.zeros(3, device=device)  # summed loss, correct, samples
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            # DistributedSampler repeats samples to give every rank as many batches: count each
            # sample once, by its index rank + k * world_size.
            index = sampler.rank + sampler.num_replicas * torch.arange(seen, seen + len(data))
            real = (index < len(sampler.dataset)).to(device)
            seen += len(data)
            totals[0] += F.nll_loss(output[real], target[real], reduction="sum")
            totals[1] += (output.argmax(dim=1) == target)[real].sum()
            totals[2] += real.sum()
            if dry_run:
                break
    dist.all_reduce(totals)
    test_loss, correct, count = totals[0].item() / totals[2].item(), int(totals[1]), int(totals[2])
    rank0_print(f"Test set: Average loss: {test_loss:.4f}, "
                f"Accuracy: {correct}/{count} ({100.0 * correct / count:.2f}%)\n")
    return test_loss, correct / count


# ------------------------------------------------------------------------------------ checkpoint
def save_model(model, path="mnist_cnn.pt"):
    """Save the state dict from rank 0: it loads into a plain Net()."""
    # The same call as under FSDP; here it drops DDP's "module." prefix and copies to the CPU.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if dist.get_rank() == 0:
        torch.save(state, f"{path}.tmp")
        os.replace(f"{path}.tmp", path)  # no reader ever sees a half-written file
        rank0_print(f"Saved {os.path.abspath(path)}")


# ------------------------------------------------------------------------------------------ main
def main(args, device):
    # 1. Check the flags and the outputs before any work (one line from rank 0 if they cannot).
    agree_on_error(flag_problem(args, device, dist.get_world_size()))
    quiet_known_warnings()  # library warnings that say nothing a user can act on
    torch.manual_seed(args.seed)
    checkpoint = os.path.abspath("mnist_cnn.pt") if args.save_model else None
    check_outputs(args.metrics_json, {}, {"--save-model": checkpoint})
    # 2. Data: every rank reads its own part of each set (DistributedSampler).
    train_set, test_set = checked_mnist(args.data_dir, load_mnist)  # a bad download: one line
    loader_kwargs = {"num_workers": 2, "pin_memory": True} if device.type == "cuda" else {}
    train_loader = DataLoader(train_set, batch_size=args.batch_size, **loader_kwargs,
                              sampler=DistributedSampler(train_set, shuffle=True, seed=args.seed))
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, **loader_kwargs,
                             sampler=DistributedSampler(test_set, shuffle=False))
    # 3. The model, replicated on every rank by DDP.
    model = wrap_model(Net(), device)
    # 4. The optimizer, over the replica's parameters; lr decays every epoch.
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)
    stop_on_non_finite_gradients(optimizer, DIVERGED)  # a diverged run stops at once
    # 5. Train and test, epoch by epoch.
    report, train_losses = Report(args.metrics_json, device), []
    for epoch in range(1, args.epochs + 1):
        train_losses.append(train(model, device, train_loader, optimizer, epoch, args.dry_run))
        test_loss, accuracy = test(model, device, test_loader, args.dry_run)
        scheduler.step()
        report.lap()
    report.training_done(model, optimizer)  # the last step's gradients are still held
    # 6. Save the full state dict (rank 0): never a diverged model, and not beyond the free space.
    if checkpoint:
        stop_if_diverged("a parameter", list(model.parameters()), DIVERGED)
        with saving([checkpoint], nbytes(tensors_in(model.module.state_dict())),
                    "run it in another folder"):
            save_model(model, checkpoint)
    report.write(train_loss=train_losses[-1], train_losses=train_losses, test_loss=test_loss,
                 accuracy=accuracy, epoch_times=report.laps, checkpoint=checkpoint)


def parse_args(argv=None):
    parser = RankZeroArgumentParser(
        description="PyTorch MNIST example with DDP (DistributedDataParallel)")
    add = parser.add_argument_group("training").add_argument
    add("--batch-size", type=positive(int), default=64, metavar="N", help="batch per process")
    add("--test-batch-size", type=positive(int), default=1000, metavar="N", help="test batch")
    add("--epochs", type=positive(int), default=10, metavar="N", help="number of epochs to train")
    add("--lr", type=positive(float, most=1e30), default=1.0, metavar="LR",
        help="Adadelta learning rate, at most 1e30 (much larger ones overflow float32)")
    add("--gamma", type=positive(float, zero=True, most=1), default=0.7, metavar="M",
        help="learning rate step gamma per epoch")
    add("--seed", type=positive(int, zero=True, most=2**32 - 1), default=1, metavar="S",
        help="random seed (init, dropout, shuffling)")
    add("--dry-run", action="store_true", help="one training and one test batch per epoch")
    add = parser.add_argument_group("data").add_argument
    add("--data-dir", default="data", help="folder of MNIST/raw; downloaded there if missing")
    add = add_run_flags(parser)  # --cpu, --world-size, --dist-timeout, --metrics-json
    add("--save-model", action="store_true", help="save ./mnist_cnn.pt (loads into a plain Net)")
    return parser.parse_args(argv)


if __name__ == "__main__":  # main on every rank, however the job was started
    launch(main, parse_args(), memory_advice=MEMORY_ADVICE, check=flag_problem,
           resume_hint="MNIST runs keep no checkpoint: a rerun starts from epoch 1")
