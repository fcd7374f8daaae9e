"""Write an MNIST-format data folder from scikit-learn's bundled handwritten digits (no download).

    python tests/digits_mnist.py data        # then: python fsdp1_mnist.py --data-dir data

The 8x8 digits are scaled to 20x20 and centred in 28x28, as MNIST's are, and written as the IDX
files of MNIST/raw, so torchvision's real MNIST loader reads them with download=False and the
MNIST network learns them (about 95% test accuracy after 3 epochs).
"""
import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

try:
    from sklearn.datasets import load_digits
except ModuleNotFoundError as e:  # run as a command without scikit-learn: one line, no traceback
    if __name__ != "__main__" or not (e.name or "").startswith("sklearn"):
        raise
    sys.exit("error: tests/digits_mnist.py writes the handwritten digits that scikit-learn ships, "
             "and scikit-learn is not installed: pip install scikit-learn")

# The test-set size is divisible by neither 2 nor 3, so DistributedSampler pads it at both
# world sizes the tests use.
TRAIN_SIZE, TEST_SIZE = 1500, 295


def write_idx(path, array):
    """Write a uint8 array in the MNIST files' IDX format (big-endian header, then the bytes)."""
    magic = bytes([0, 0, 0x08, array.ndim])  # 0x08: unsigned byte
    dims = b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(magic + dims + array.astype(np.uint8).tobytes())


def write_digits_mnist(root):
    digits = load_digits()
    order = np.random.default_rng(0).permutation(len(digits.target))[: TRAIN_SIZE + TEST_SIZE]
    small = torch.tensor(digits.images[order], dtype=torch.float32).unsqueeze(1) * (255.0 / 16.0)
    images = F.interpolate(small, size=(20, 20), mode="bilinear", align_corners=False)
    images = F.pad(images, (4, 4, 4, 4)).squeeze(1).clamp(0, 255).round().numpy()
    labels = digits.target[order]
    raw = Path(root) / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    for prefix, part in (("train", slice(0, TRAIN_SIZE)), ("t10k", slice(TRAIN_SIZE, None))):
        write_idx(raw / f"{prefix}-images-idx3-ubyte", images[part])
        write_idx(raw / f"{prefix}-labels-idx1-ubyte", labels[part])
    return Path(root)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Write MNIST-format files of scikit-learn's "
                                     "handwritten digits into DATA_DIR/MNIST/raw, offline.")
    parser.add_argument("data_dir", help="the scripts' --data-dir")
    raw = write_digits_mnist(parser.parse_args().data_dir) / "MNIST" / "raw"
    print(f"wrote {TRAIN_SIZE} training and {TEST_SIZE} test digits to {raw}")
