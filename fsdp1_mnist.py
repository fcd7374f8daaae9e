"""FSDP1 (FullyShardedDataParallel) training of the MNIST CNN, on GPUs or on CPU.

A working version of the PyTorch "Getting Started with FSDP" tutorial, with the FSDP1 options
(sharding strategy, backward prefetch, CPU offload, use_orig_params) as flags. ddp_mnist.py is
the same program with DDP, the baseline it is compared with.

Launch it either way:
    python fsdp1_mnist.py                      # one process per GPU; 2 CPU processes without GPUs
    python fsdp1_mnist.py --no-cuda --world-size 4 --epochs 1
    torchrun --nproc_per_node 4 fsdp1_mnist.py --auto-wrap-min-params 20000
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        fsdp1_mnist.py --sharding-strategy HYBRID_SHARD

CUDA + NCCL are used when a GPU is visible, CPU + gloo otherwise (or with --no-cuda). MNIST is
downloaded into --data-dir on first use where there is network.
"""
import argparse
import datetime
import functools
import gc
import json
import math
import os
import re
import resource
import shutil
import socket
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import BackwardPrefetch, CPUOffload, ShardingStrategy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from torch.optim.lr_scheduler import StepLR
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from torchvision import datasets, transforms

MNIST_FILES = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")


def rank0_print(*args, **kwargs):
    if int(os.environ.get("RANK", "0")) == 0:
        print(*args, **kwargs, flush=True)


def fail(message, node_local=False):
    """Stop this rank with exit code 1. Rank 0 says what is wrong in one line, without a traceback (with
    node_local, each node's local rank 0 does: for a problem of one node)."""
    if int(os.environ.get("LOCAL_RANK" if node_local else "RANK", "0")) == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    else:
        wait_for_rank0_to_report()
    sys.exit(1)


def wait_for_rank0_to_report():
    """torchrun stops every worker as soon as one fails: a rank that left first could have rank 0 killed before
    it prints why. Rank 0 exits right after its line, and torchrun then stops the ranks still waiting here."""
    time.sleep(10)


def agree_on_error(error):
    """Fail on every rank if any rank found an error, so that no rank waits forever for the others."""
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), None)
    if first:
        fail(first)


def output_error(outputs):
    """Why a file cannot be written into one of the {flag: directory} folders (made if missing), or None.
    Checked before training, so that a bad path fails the run in seconds instead of at the first save."""
    for flag, directory in outputs.items():
        if not directory:
            continue
        if os.path.exists(directory) and not os.path.isdir(directory):
            return f"{flag}: {directory} is a file, so nothing can be written into it; pass another path"
        try:
            os.makedirs(directory, exist_ok=True)
            tempfile.TemporaryFile(dir=directory).close()  # creating a file is the only test that holds for root too
        except OSError as e:
            return f"{flag}: cannot write into {directory} ({e.strerror or e}); pass a writable directory"
    return None


def peer_lost(error):
    """Whether a failed collective means another rank stopped answering: gloo raises a RuntimeError naming
    its transport, the other backends a DistError. (NCCL's watchdog usually ends the process itself.)"""
    return isinstance(error, dist.DistError) or "gloo" in str(error)


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


def idx_problem(path):
    """Why path is not a complete IDX file of unsigned bytes (MNIST's format), or None. Asked only when
    torchvision's reader has failed: it says so with an empty AssertionError or a reshape error, naming no file."""
    if not os.path.isfile(path):
        return f"{os.path.basename(path)} is missing"
    with open(path, "rb") as f:
        data = f.read()  # at most 47 MB
    if len(data) < 4 or data[:3] != b"\x00\x00\x08":
        return f"{os.path.basename(path)} does not start with an IDX header"
    dims = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(data[3])]
    expected = 4 + 4 * len(dims) + math.prod(dims)
    if len(data) != expected:
        return f"{os.path.basename(path)} has {len(data)} bytes where its header says {expected}: truncated?"
    return None


def load_mnist(data_dir, local_rank):
    """Return the MNIST train and test sets, downloading them once per node if they are missing."""
    raw_dir = os.path.join(os.path.abspath(data_dir), "MNIST", "raw")
    error = None
    if local_rank == 0 and not all(os.path.exists(os.path.join(raw_dir, f)) for f in MNIST_FILES):
        new_dirs = [d for d in (os.path.abspath(data_dir), os.path.dirname(raw_dir), raw_dir) if not os.path.exists(d)]
        try:
            datasets.MNIST(data_dir, train=True, download=True)
        except Exception as e:
            if new_dirs:  # the folders the failed download made, and any partial file in them
                shutil.rmtree(new_dirs[0], ignore_errors=True)
            reason = str(e).strip().splitlines()[-1]
            error = (f"MNIST is not in {raw_dir} and downloading it failed ({reason}). On a machine with network "
                     f"run: python -c \"from torchvision.datasets import MNIST; MNIST('data', download=True)\" and "
                     f"pass --data-dir data (or copy data/MNIST into {os.path.abspath(data_dir)}).")
    agree_on_error(error)  # also makes the other ranks wait for the download

    transform = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.1307,), (0.3081,))])
    try:
        train_set = datasets.MNIST(data_dir, train=True, transform=transform)
        test_set = datasets.MNIST(data_dir, train=False, transform=transform)
    except Exception as e:
        problem = next(filter(None, (idx_problem(os.path.join(raw_dir, f)) for f in MNIST_FILES)), None)
        error = (f"cannot read MNIST from {raw_dir} ({problem or ' '.join(str(e).split()) or type(e).__name__}); "
                 "delete that folder to download it again.")
    agree_on_error(error)
    return train_set, test_set


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
    train_loss = (totals[0] / totals[1]).item()
    rank0_print(f"Train Epoch: {epoch} \tLoss: {train_loss:.6f}")
    return train_loss


def test(model, device, loader, dry_run):
    model.eval()
    sampler = loader.sampler
    totals = torch.zeros(3, device=device)  # summed loss, correct, samples
    seen = 0
    with torch.no_grad():
        for data, target in loader:
            data, target = data.to(device), target.to(device)
            output = model(data)
            # DistributedSampler pads the test set with repeated samples so that every rank runs the
            # same number of batches (FSDP needs every rank in every forward). Count each real sample
            # once: this rank's k-th sample sits at position rank + k * world_size of the padded list.
            position = sampler.rank + sampler.num_replicas * torch.arange(seen, seen + len(data), device=device)
            real = position < len(sampler.dataset)
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


def train_state_bytes(model, optimizer):
    """Bytes this rank holds in parameters, gradients and optimizer state (local shards under FSDP)."""
    params = list(model.parameters())
    tensors = params + [p.grad for p in params if p.grad is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors)


def max_over_ranks(value, device):
    t = torch.tensor(float(value), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def save_atomic(obj, path):
    """Write to a temporary name and rename, so that no reader ever sees a half-written file."""
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train_and_test(args, device):
    rank, world_size, local_rank = dist.get_rank(), dist.get_world_size(), int(os.environ["LOCAL_RANK"])
    use_cuda = device.type == "cuda"
    metrics_dir = args.metrics_json and os.path.dirname(os.path.abspath(args.metrics_json))
    outputs = {"--save-model (./mnist_cnn.pt)": args.save_model and os.getcwd(), "--metrics-json": metrics_dir}
    agree_on_error(output_error(outputs) if rank == 0 else None)
    train_set, test_set = load_mnist(args.data_dir, local_rank)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=args.seed)
    test_sampler = DistributedSampler(test_set, shuffle=False)
    loader_kwargs = {"num_workers": 2, "pin_memory": True} if use_cuda else {}
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler, **loader_kwargs)
    test_loader = DataLoader(test_set, batch_size=args.test_batch_size, sampler=test_sampler, **loader_kwargs)

    strategy = ShardingStrategy[args.sharding_strategy]
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    if strategy == ShardingStrategy.HYBRID_SHARD and local_world_size == 1 < world_size:
        # One process per node leaves nothing to shard within a node. FSDP1 would clamp the size-1 shard group
        # to NO_SHARD and then never all-reduce across the nodes: every node would train on its own.
        rank0_print("HYBRID_SHARD with one process per node only replicates: using NO_SHARD over all ranks")
        strategy = ShardingStrategy.NO_SHARD
    mesh = None
    if strategy == ShardingStrategy.HYBRID_SHARD:
        # Shard within a node, replicate across nodes: a (nodes, processes per node) mesh.
        mesh = init_device_mesh(device.type, (world_size // local_world_size, local_world_size))
    model = FSDP(
        Net(),  # built on CPU; FSDP moves it to device_id one unit at a time
        auto_wrap_policy=(functools.partial(size_based_auto_wrap_policy, min_num_params=args.auto_wrap_min_params)
                          if args.auto_wrap_min_params > 0 else None),
        sharding_strategy=strategy,
        device_mesh=mesh,
        cpu_offload=CPUOffload(offload_params=True) if args.cpu_offload else None,
        backward_prefetch=None if args.backward_prefetch == "NONE" else BackwardPrefetch[args.backward_prefetch],
        use_orig_params=args.use_orig_params,
        device_id=device,  # also on CPU: without it FSDP1 looks for an accelerator and refuses to start
    )
    rank0_print(model)
    optimizer = optim.Adadelta(model.parameters(), lr=args.lr)
    scheduler = StepLR(optimizer, step_size=1, gamma=args.gamma)

    if use_cuda:
        start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start_event.record()
    start = time.perf_counter()
    train_losses, epoch_times = [], []
    for epoch in range(1, args.epochs + 1):
        epoch_start = time.perf_counter()
        train_losses.append(train(model, device, train_loader, optimizer, epoch, args.dry_run))
        test_loss, accuracy = test(model, device, test_loader, args.dry_run)
        scheduler.step()
        epoch_times.append(time.perf_counter() - epoch_start)
    wall_s = time.perf_counter() - start
    if use_cuda:
        end_event.record()
        end_event.synchronize()
        rank0_print(f"CUDA event elapsed time: {start_event.elapsed_time(end_event) / 1000:.3f}sec")
    else:
        rank0_print(f"Wall-clock elapsed time: {wall_s:.3f}sec")

    # Sizes are fixed from the first optimizer step on; the last step's gradients are still held.
    state_bytes = max_over_ranks(train_state_bytes(model, optimizer), device)
    peak = (torch.cuda.max_memory_allocated(device) if use_cuda
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # ru_maxrss is in KiB
    peak = max_over_ranks(peak, device)
    rank0_print(f"Peak memory per rank ({'CUDA allocated' if use_cuda else 'process RSS'}): {peak / 2**20:.1f} MB; "
                f"parameters + gradients + optimizer state: {state_bytes / 2**20:.2f} MB")

    checkpoint = None
    if args.save_model:
        # Every rank takes part in gathering the full (unsharded) state dict; with cpu_offload only
        # rank 0 receives it, on CPU, so no rank ever holds a second full copy on its device.
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        checkpoint = os.path.abspath("mnist_cnn.pt")
        if rank == 0:
            save_atomic(state, checkpoint)
            rank0_print(f"Saved {checkpoint}")

    if args.metrics_json and rank == 0:
        metrics = {
            "script": os.path.basename(__file__), "world_size": world_size, "device": device.type,
            "backend": dist.get_backend(), "train_loss": train_losses[-1], "train_losses": train_losses,
            "test_loss": test_loss, "accuracy": accuracy, "wall_s": wall_s, "epoch_times": epoch_times,
            "train_state_bytes": state_bytes, "peak_memory_bytes": peak, "checkpoint": checkpoint,
            "sharding_strategy": strategy.name, "auto_wrap_min_params": args.auto_wrap_min_params,
        }
        tmp = f"{args.metrics_json}.tmp"
        with open(tmp, "w") as f:
            json.dump(metrics, f, indent=2)
        os.replace(tmp, args.metrics_json)


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    use_cuda = torch.cuda.is_available() and not args.no_cuda
    if args.cpu_offload and not use_cuda:
        fail("--cpu-offload moves parameters between GPU and host memory and needs a CUDA GPU; "
             "none is in use here (drop --cpu-offload, or run on a GPU without --no-cuda).")
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if use_cuda and local_world_size > torch.cuda.device_count():
        fail(f"{local_world_size} processes on this node but {torch.cuda.device_count()} GPUs visible; start at most "
             "one process per GPU (torchrun --nproc_per_node).", node_local=True)
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed)

    try:
        # A collective that waits longer than --dist-timeout for a peer fails the job instead of hanging it.
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.dist_timeout))
        train_and_test(args, device)  # its model and optimizer are garbage once it returns
    except RuntimeError as e:
        if not peer_lost(e):
            raise
        # Said by every rank that notices: the rank that was lost may be rank 0.
        reason = re.sub(r"^\[[^]]*\] ", "", str(e).strip().splitlines()[0])  # gloo prefixes its source location
        print(f"error: rank {os.environ['RANK']}: a collective failed ({reason}): another rank died, hung or lost "
              f"its network, or took longer than --dist-timeout {args.dist_timeout:g}s; see the other ranks' logs",
              file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        # FSDP's units keep the process group alive through reference cycles. Free them now, while the
        # interpreter is fully alive: left to the exit, gloo's worker threads can abort a finished run
        # with SIGABRT ("terminate called without an active exception").
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_worker(local_rank, world_size, port, args):
    # Set what torchrun would set, so that both launch modes run the same code.
    os.environ.update(RANK=str(local_rank), LOCAL_RANK=str(local_rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if "OMP_NUM_THREADS" not in os.environ:  # like torchrun: share the cores instead of oversubscribing them
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    main(args)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankZeroArgumentParser(argparse.ArgumentParser):
    """Reports a usage error once, from rank 0, instead of once per torchrun worker."""

    def error(self, message):
        if int(os.environ.get("RANK", "0")) == 0:
            super().error(message)
        wait_for_rank0_to_report()
        sys.exit(2)


def positive_int(text):
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def positive_float(text):
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


if __name__ == "__main__":
    parser = RankZeroArgumentParser(description="PyTorch MNIST example with FSDP1 (FullyShardedDataParallel)",
                                    formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--batch-size", type=positive_int, default=64, metavar="N",
                        help="input batch size per process for training")
    parser.add_argument("--test-batch-size", type=positive_int, default=1000, metavar="N",
                        help="input batch size per process for testing")
    parser.add_argument("--epochs", type=positive_int, default=10, metavar="N", help="number of epochs to train")
    parser.add_argument("--lr", type=float, default=1.0, metavar="LR", help="Adadelta learning rate")
    parser.add_argument("--gamma", type=float, default=0.7, metavar="M", help="learning rate step gamma (per epoch)")
    parser.add_argument("--no-cuda", action="store_true", help="train on CPU with gloo even when GPUs are present")
    parser.add_argument("--dry-run", action="store_true", help="one training and one test batch per epoch")
    parser.add_argument("--seed", type=int, default=1, metavar="S", help="random seed (model init, dropout, shuffling)")
    parser.add_argument("--save-model", action="store_true",
                        help="save the full state dict to ./mnist_cnn.pt (loads into the plain Net)")
    parser.add_argument("--data-dir", default="../data", help="folder holding MNIST/raw; downloaded there if missing")
    parser.add_argument("--world-size", type=positive_int, default=None, metavar="N",
                        help="processes to spawn when started with python (default: GPU count, or 2 on CPU); "
                             "under torchrun, --nproc_per_node decides")
    parser.add_argument("--dist-timeout", type=positive_float, default=600, metavar="S",
                        help="seconds a collective waits for the other ranks before the job fails (a lost or hung "
                             "peer); must exceed the longest pause of one rank, such as the MNIST download")
    parser.add_argument("--metrics-json", default=None, metavar="PATH", help="write final metrics to PATH (rank 0)")
    parser.add_argument("--auto-wrap-min-params", type=int, default=0, metavar="N",
                        help="wrap every submodule with at least N parameters in its own FSDP unit "
                             "(0: the whole model is one unit; the tutorial's advanced section uses 20000)")
    parser.add_argument("--cpu-offload", action="store_true",
                        help="keep parameters and gradients in host memory between uses (needs a GPU)")
    parser.add_argument("--sharding-strategy", default="FULL_SHARD",
                        choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"],
                        help="FULL_SHARD shards parameters, gradients and optimizer state (ZeRO-3); SHARD_GRAD_OP "
                             "keeps parameters gathered from forward to backward (ZeRO-2); NO_SHARD is DDP-like; "
                             "HYBRID_SHARD shards within a node and replicates across nodes")
    parser.add_argument("--backward-prefetch", default="BACKWARD_PRE",
                        choices=["BACKWARD_PRE", "BACKWARD_POST", "NONE"],
                        help="when to all-gather the next unit's parameters in backward")
    parser.add_argument("--use-orig-params", action="store_true",
                        help="expose the original parameters to the optimizer instead of FSDP's flat parameters")
    args = parser.parse_args()

    if "RANK" in os.environ:  # started by torchrun
        if args.world_size and args.world_size != int(os.environ["WORLD_SIZE"]):
            parser.error(f"--world-size {args.world_size} disagrees with torchrun's WORLD_SIZE "
                         f"{os.environ['WORLD_SIZE']}; leave --world-size out under torchrun")
        main(args)
    else:
        use_cuda = torch.cuda.is_available() and not args.no_cuda
        world_size = args.world_size or (torch.cuda.device_count() if use_cuda else 2)
        if use_cuda and world_size > torch.cuda.device_count():
            parser.error(f"--world-size {world_size} asks for more GPUs than the {torch.cuda.device_count()} present")
        try:
            mp.spawn(spawn_worker, args=(world_size, free_port(), args), nprocs=world_size)
        except mp.ProcessExitedException as e:  # the failing worker has already said why
            sys.exit(e.exit_code or 1)
