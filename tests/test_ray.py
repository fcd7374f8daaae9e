"""fsdp2_transformer.py in Ray Train's workers: TorchTrainer makes the process group and runs the
script as `python fsdp2_transformer.py` would in each worker, which joins no other group and
trains as under torchrun. Skipped without Ray (.ci/run installs ray[train])."""
import json
import os
import subprocess
import sys

import pytest
from conftest import FSDP2_TINY, REPO

pytest.importorskip("ray.train.torch", reason="Ray Train is not installed (pip install "
                    "'ray[train]')")

# The README's snippet, with the script's flags from the command line.
DRIVER = """
import runpy
import sys

import ray
from ray.train import ScalingConfig
from ray.train.torch import TorchTrainer


def train(config):
    sys.argv = [config["script"], *config["argv"]]
    runpy.run_path(config["script"], run_name="__main__")


ray.init(num_cpus=2, include_dashboard=False)
trainer = TorchTrainer(train, scaling_config=ScalingConfig(num_workers=2, use_gpu=False),
                       train_loop_config={"script": sys.argv[1], "argv": sys.argv[2:]})
trainer.fit()
"""


def test_fsdp2_under_ray_train_trains_as_under_torchrun(tmp_path, cached_torchrun):
    args = [*FSDP2_TINY, "--steps", 10, "--cpu"]
    (tmp_path / "driver.py").write_text(DRIVER)
    metrics_path = tmp_path / "metrics.json"  # absolute: Ray's workers have their own folder
    proc = subprocess.run([sys.executable, "driver.py", REPO / "fsdp2_transformer.py",
                           *map(str, args), "--metrics-json",
                           str(metrics_path)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "PYTHONPATH": str(REPO),
                                            "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    metrics = json.loads(metrics_path.read_text())
    reference = cached_torchrun("fsdp2_transformer.py", *args)
    assert metrics["world_size"] == 2 and metrics["device"] == "cpu"
    assert metrics["losses"] == pytest.approx(reference.metrics["losses"], rel=1e-6)
