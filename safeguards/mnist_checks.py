"""fsdp1_mnist.py's and ddp_mnist.py's checks: MNIST's files and contents, and a flag the device
cannot honour."""
import math
import os
import shutil

from .launch import local_rank_zero_first

# What the one-line errors advise when memory runs out, or when training diverges.
MEMORY_ADVICE = "use a smaller --batch-size or --test-batch-size"
DIVERGED = "try a smaller --lr"

def flag_problem(args, device, world_size):
    """Why these flags cannot work on this device, or None."""
    if getattr(args, "cpu_offload", False) and device.type != "cuda":
        return ("--cpu-offload moves parameters between GPU and host memory and needs a CUDA GPU; "
                "none is in use here (drop --cpu-offload, or run on a GPU without --cpu).")
    return None


MNIST_FILES = [f"{split}-{kind}-ubyte" for split in ("train", "t10k")
               for kind in ("images-idx3", "labels-idx1")]


def checked_mnist(data_dir, load):
    """load(data_dir), MNIST's (train, test) sets, on each node's local rank 0 first (which
    downloads missing files once per node), then on the node's other ranks (local_rank_zero_first);
    a problem (loaded_mnist) stops every rank with its line."""
    return local_rank_zero_first(lambda: loaded_mnist(data_dir, load))


def loaded_mnist(data_dir, load):
    """load(data_dir), or a ValueError of one line saying what to do: a failed download (which
    leaves no empty folders behind), a file torchvision cannot read, or contents that cannot be
    trained on."""
    raw_dir = os.path.join(os.path.abspath(data_dir), "MNIST", "raw")
    missing = not all(os.path.exists(os.path.join(raw_dir, name)) for name in MNIST_FILES)
    made = [d for d in (os.path.abspath(data_dir), os.path.dirname(raw_dir), raw_dir)
            if not os.path.exists(d)]
    try:  # torchvision downloads only missing files
        sets = load(data_dir)
    except Exception as e:
        if missing:  # a failed download leaves no empty folders behind
            for folder in made[:1]:
                shutil.rmtree(folder, ignore_errors=True)
            raise ValueError(  # the last line of torchvision's message says why
                f"MNIST is not in {raw_dir} and downloading it failed ("
                f"{str(e).strip().splitlines()[-1]}). On a machine with network, python -c "
                "\"from torchvision.datasets import MNIST; MNIST('data', download=True)\" "
                "downloads it into data/MNIST: copy that into "
                f"{os.path.abspath(data_dir)} or pass --data-dir data; or, offline, python "
                f"tests/digits_mnist.py {data_dir} (in this repository) writes MNIST-format "
                "files there from scikit-learn's digits.")
        problems = [idx_problem(os.path.join(raw_dir, name)) for name in MNIST_FILES]
        raise ValueError(f"cannot read MNIST from {raw_dir} ("  # torchvision names no file
                         f"{next(filter(None, problems), None) or repr(e)}); delete that "
                         "folder to download it again.")
    for dataset in sets:  # the files' headers were fine; do their contents agree?
        problem = mnist_problem(dataset)
        if problem:
            raise ValueError(f"cannot use MNIST from {raw_dir} ({problem}); delete that "
                             "folder to download it again.")
    return sets


def mnist_problem(dataset):
    """Why a loaded MNIST split cannot be trained on (image and label counts, sizes, labels)."""
    images, labels, split = dataset.data, dataset.targets, "train" if dataset.train else "t10k"
    if len(images) != len(labels):
        return f"{split} has {len(images)} images but {len(labels)} labels"
    if tuple(images.shape[1:]) != (28, 28):
        return f"{split}'s images are {'x'.join(map(str, images.shape[1:]))} pixels, not 28x28"
    if len(labels) and not 0 <= int(labels.min()) <= int(labels.max()) <= 9:
        return f"{split} has labels outside 0-9 (from {int(labels.min())} to {int(labels.max())})"
    return None


def idx_problem(path):
    """Why path is not a complete IDX file (MNIST's format), or None."""
    with open(path, "rb") as f:  # it exists: torchvision would have downloaded it otherwise
        data = f.read()
    if len(data) < 4 or data[:3] != b"\x00\x00\x08":
        return f"{os.path.basename(path)} does not start with an IDX header"
    size = 4 + 4 * data[3] + math.prod(int.from_bytes(data[i:i + 4], "big")
                                       for i in range(4, 4 + 4 * data[3], 4))
    if len(data) != size:
        return f"{os.path.basename(path)} has {len(data)} bytes, its header says {size}: truncated?"
