"""Two nodes on one machine: two torchrun agents (--nnodes 2, one process each) that meet through
c10d rendezvous on localhost, as two machines would. The results must be those of one node with 2
processes."""
import json
import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from conftest import (
    FSDP2_REFERENCE,
    FSDP2_TINY,
    MNIST_TINY,
    REPO,
    TORCHRUN,
    Run,
    copy_fsdp2_checkpoint,
    free_ports,
    run_command,
    t5_args,
)

HYBRID = ["--sharding-strategy", "HYBRID_SHARD", "--backward-prefetch", "NONE"]


def run_agents(tmp_path, commands, envs, timeout=300, grace=60):
    """Run the agents' commands (node 0's, node 1's), each in tmp_path/node<N> with its envs entry
    added to the environment, as new processes (real agents: not tests/forked_torchrun.py's
    forks, which read no PET_* variable); return their Runs. A job whose node is gone
    leaves the other waiting: its workers in a collective (--dist-timeout), its agent at
    torchelastic's exit barrier (300 s, pytorch/pytorch#69520). So an agent still running `grace`
    seconds after the other ended, or any after `timeout`, is killed with its workers, and the
    test fails showing both nodes' output rather than only the survivor's timeout."""
    agents = []
    for node, (command, env) in enumerate(zip(commands, envs)):
        folder = tmp_path / f"node{node}"
        folder.mkdir(exist_ok=True)
        (folder / "metrics.json").unlink(missing_ok=True)  # never read an earlier run's
        with open(folder / "stdout.txt", "w") as stdout, open(folder / "stderr.txt", "w") as stderr:
            agents.append(subprocess.Popen(  # into files: a pipe nobody reads fills and blocks
                [str(part) for part in command], cwd=folder, env={**os.environ, **env},
                stdout=stdout, stderr=stderr, start_new_session=True))
    start, ended = time.monotonic(), None
    while any(agent.poll() is None for agent in agents):
        if ended is None and any(agent.poll() is not None for agent in agents):
            ended = time.monotonic()
        now = time.monotonic()
        if now - start > timeout or (ended is not None and now - ended > grace):
            for agent in agents:
                if agent.poll() is None:
                    os.killpg(agent.pid, signal.SIGKILL)  # the agent and its workers
        time.sleep(0.2)
    runs = []
    for node, agent in enumerate(agents):
        folder = tmp_path / f"node{node}"
        metrics = folder / "metrics.json"
        runs.append(Run(agent.returncode, (folder / "stdout.txt").read_text(),
                        (folder / "stderr.txt").read_text(),
                        json.loads(metrics.read_text()) if metrics.exists() else None, folder))
    return runs


def run_two_nodes(tmp_path, script, *args, nproc_per_node=1):
    """Start node 0 and node 1, each in its own folder; return the metrics global rank 0 wrote."""
    endpoint = f"127.0.0.1:{free_ports(1)[0]}"
    agents = []
    with ThreadPoolExecutor(max_workers=2) as pool:
        for node in (0, 1):
            folder = tmp_path / f"node{node}"
            folder.mkdir(exist_ok=True)
            command = [*TORCHRUN, "--nnodes", 2, "--node-rank", node, "--nproc-per-node",
                       nproc_per_node, "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint,
                       "--rdzv-id", "test", REPO / script, *args, "--metrics-json", "metrics.json"]
            # torchrun sets one thread per process only for several processes per node; the
            # one-node runs have it.
            agents.append(pool.submit(run_command, command, folder, 300, {"OMP_NUM_THREADS": "1"}))
        runs = [agent.result() for agent in agents]
    assert [run.returncode for run in runs] == [0, 0], "\n".join(run.output for run in runs)
    written = [run.metrics for run in runs if run.metrics]
    # c10d rendezvous orders the nodes as they arrive: either may be rank 0
    assert len(written) == 1, written
    return written[0]


def test_fsdp2_on_two_nodes_matches_one_node(tmp_path, fsdp2_reference):
    """Both nodes start from a copy of the one-node run's step-10 checkpoint (only rank 0 reads it,
    with the DTensor API) and must go on exactly as that run did, to the same step-20 checkpoint."""
    for node in (0, 1):
        copy_fsdp2_checkpoint(fsdp2_reference, 10, tmp_path / f"node{node}" / "ckpt")
    metrics = run_two_nodes(tmp_path, "fsdp2_transformer.py", *FSDP2_REFERENCE)
    assert metrics["world_size"] == 2 and metrics["first_step"] == 11
    assert metrics["losses"] == pytest.approx(fsdp2_reference.metrics["losses"][10:], rel=1e-6)
    assert metrics["grad_norms"] == pytest.approx(fsdp2_reference.metrics["grad_norms"][10:],
                                                  rel=1e-6)
    final = torch.load(os.path.join(metrics["checkpoint"], "model.pt"), weights_only=True)
    expected = torch.load(fsdp2_reference.cwd / "ckpt" / "step_000020" / "model.pt",
                          weights_only=True)
    assert all(torch.allclose(final[k], expected[k], rtol=1e-6, atol=1e-7) for k in expected)


def test_fsdp1_hybrid_shard_on_two_nodes_matches_one_node(tmp_path, cached_torchrun, mnist_dir):
    """HYBRID_SHARD shards within a node and replicates across nodes: on 2 nodes of 1 process each,
    every rank holds the whole model (a 2 x 1 mesh), on 1 node of 2 processes half of it (1 x 2).
    Same losses either way."""
    args = ["--data-dir", mnist_dir, "--epochs", 2, *MNIST_TINY, *HYBRID]
    two_nodes = run_two_nodes(tmp_path, "fsdp1_mnist.py", *args)
    one_node = cached_torchrun("fsdp1_mnist.py", *args)
    assert one_node.returncode == 0, one_node.output
    # NO_SHARD: see the script
    assert two_nodes["world_size"] == 2 and two_nodes["sharding_strategy"] == "NO_SHARD"
    assert two_nodes["train_losses"] == pytest.approx(one_node.metrics["train_losses"], rel=1e-4)
    assert two_nodes["accuracy"] == pytest.approx(one_node.metrics["accuracy"], abs=1 / 295)
    assert two_nodes["train_state_bytes"] >= 1.9 * one_node.metrics["train_state_bytes"]


def test_fsdp2_hsdp_on_two_nodes_matches_one_process(tmp_path, cached_torchrun, fsdp2_reference):
    """--replicate-degree 2 on 2 nodes of 2 processes: a (2, 2) mesh that shards within a node and
    replicates across nodes. One process's losses, the training state of plain FSDP on 2 ranks
    (world size / R), and a full checkpoint like that run's."""
    metrics = run_two_nodes(tmp_path, "fsdp2_transformer.py", *FSDP2_REFERENCE,
                            "--replicate-degree", 2, nproc_per_node=2)
    one = cached_torchrun("fsdp2_transformer.py", *FSDP2_TINY, "--steps", 20, "--cpu", nproc=1)
    assert one.returncode == 0, one.output
    assert metrics["world_size"] == 4
    assert metrics["losses"] == pytest.approx(one.metrics["losses"], rel=1e-5)
    assert metrics["train_state_bytes"] == fsdp2_reference.metrics["train_state_bytes"]
    final = torch.load(os.path.join(metrics["checkpoint"], "model.pt"), weights_only=True)
    expected = torch.load(fsdp2_reference.cwd / "ckpt" / "step_000020" / "model.pt",
                          weights_only=True)
    assert all(torch.allclose(final[k], expected[k], rtol=1e-4, atol=1e-6) for k in expected)


def test_t5_hybrid_shard_on_two_nodes_matches_one_node(tmp_path, t5_reference, tiny_t5_dir,
                                                       wikihow_dir):
    """t5_fsdp_finetune.py HYBRID_SHARD on 2 nodes of 1 process: NO_SHARD over all ranks (see
    fsdp1_mnist.py's test), and the epoch losses of one node's FULL_SHARD run."""
    metrics = run_two_nodes(tmp_path, "t5_fsdp_finetune.py", *t5_args(tiny_t5_dir, wikihow_dir, 2),
                            *HYBRID, "--mixed-precision", "fp32", "--no-save-model")
    assert metrics["world_size"] == 2 and metrics["sharding_strategy"] == "NO_SHARD"
    for key in ("train_losses", "val_losses"):
        assert metrics[key] == pytest.approx(t5_reference.metrics[key][:2], rel=1e-4)


def test_t5_fsdp2_hybrid_shard_on_two_nodes_matches_one_rank(tmp_path, cached_torchrun,
                                                            still_t5_dir, wikihow_dir):
    """t5_fsdp_finetune.py --fsdp-version 2 HYBRID_SHARD on 2 nodes of 2 processes: HSDP on a
    (2, 2) mesh, replicated across the nodes, sharded within each. Without dropout and with the
    same global batch (8: 2 per rank), the losses of one rank within 1e-5."""
    def args(ranks):  # as tests/test_t5.py's still_args: its 1-rank run serves here too
        return [*t5_args(still_t5_dir, wikihow_dir, 2), "--lr", 0.002, "--batch-size", 8 // ranks,
                "--fsdp-version", 2, "--no-save-model"]

    metrics = run_two_nodes(tmp_path, "t5_fsdp_finetune.py", *args(4), "--sharding-strategy",
                            "HYBRID_SHARD", nproc_per_node=2)
    one = cached_torchrun("t5_fsdp_finetune.py", *args(1), nproc=1)
    assert one.returncode == 0, one.output
    assert metrics["world_size"] == 4 and metrics["sharding_strategy"] == "HYBRID_SHARD"
    # sharded within a node of 2: half of one rank's training state (a flat mesh of 4: a quarter)
    assert metrics["train_state_bytes"] / one.metrics["train_state_bytes"] == pytest.approx(
        0.5, rel=0.01)
    for key in ("train_losses", "val_losses"):
        assert metrics[key] == pytest.approx(one.metrics[key], rel=1e-5)


def test_kubeflow_environment_alone_makes_two_nodes(tmp_path, cached_torchrun):
    """Kubeflow's PyTorchJob (and Trainer) configure torchrun through PET_* variables only: two
    agents given nothing but PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK, PET_MASTER_ADDR and
    PET_MASTER_PORT form one job of 2 ranks, with one node's losses."""
    args = [*FSDP2_TINY, "--steps", 10]
    port, = free_ports(1)
    envs = [{"PET_NNODES": "2", "PET_NPROC_PER_NODE": "1", "PET_NODE_RANK": str(node),
             "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            for node in (0, 1)]
    command = [*TORCHRUN, REPO / "fsdp2_transformer.py", *args, "--metrics-json", "metrics.json"]
    runs = run_agents(tmp_path, [command, command], envs)
    assert [run.returncode for run in runs] == [0, 0], "\n".join(
        f"node {node}: exit {run.returncode}\n{run.output}" for node, run in enumerate(runs))
    metrics = runs[0].metrics  # the static rendezvous: node rank 0 holds rank 0
    one_node = cached_torchrun("fsdp2_transformer.py", *args)
    assert metrics["world_size"] == 2 and runs[1].metrics is None
    assert metrics["losses"] == pytest.approx(one_node.metrics["losses"], rel=1e-6)
