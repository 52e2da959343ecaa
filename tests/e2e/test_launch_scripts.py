"""The launch scripts (examples/launch/torchrun_multinode.sh, slurm.sbatch), checked without
running a trainer: valid bash, executable, and dry-run (``BAPO_DRY_RUN=1``) for the commands
they would start on each node."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
LAUNCH = REPO_ROOT / "examples" / "launch"
SCRIPTS = (LAUNCH / "torchrun_multinode.sh", LAUNCH / "slurm.sbatch")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_launch_script_is_valid_bash_and_executable(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    assert script.stat().st_mode & stat.S_IXUSR


LAUNCH_VARIABLES = (
    "NNODES",
    "NODE_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GPUS_PER_NODE",
    "ENGINE_NODES",
    "ENGINE_RANKS_PER_NODE",
    "MAX_RESTARTS",
    "RDZV_ID",
    "RDZV_READ_TIMEOUT",
    "LOCAL_ADDR",
)


def _dry_run(args: list[str], env: dict[str, str], cwd: Path = REPO_ROOT) -> str:
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    done = subprocess.run(
        args,
        env={**base, "BAPO_DRY_RUN": "1", **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def test_torchrun_script_passes_shape_and_overrides():
    out = _dry_run(
        [
            str(SCRIPTS[0]),
            "examples/deepseek-r1-distill-qwen-7b-tp4-dp4/train.yaml",
            "train.steps=3",
            "data.system_prompt=think step by step",
        ],
        {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1"},
    )
    assert shlex.split(out) == [
        "env",
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1",
        "BAPO_NODE_RANK=1",
        "torchrun",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        "10.0.0.1:29500",
        "--rdzv-id",
        "bapo-29500",
        "--rdzv-conf",
        "is_host=false,read_timeout=300",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "8",
        "--max-restarts",
        "3",
        "-m",
        "bapo_megatron.train",
        "--config",
        "examples/deepseek-r1-distill-qwen-7b-tp4-dp4/train.yaml",
        "train.steps=3",
        "data.system_prompt=think step by step",
    ]


def test_torchrun_script_restarts_as_told_and_serves_the_store_where_told():
    words = shlex.split(
        _dry_run(
            [str(SCRIPTS[0]), "examples/deepseek-r1-distill-qwen-7b-tp4-dp4/train.yaml"],
            {"MAX_RESTARTS": "0", "LOCAL_ADDR": "10.0.0.7", "RDZV_ID": "job-5"},
        )
    )
    assert words[words.index("--max-restarts") + 1] == "0"
    assert words[words.index("--local-addr") + 1] == "10.0.0.7"
    assert words[words.index("--rdzv-id") + 1] == "job-5"
    assert words[words.index("--rdzv-conf") + 1] == "is_host=true,read_timeout=300"


def test_torchrun_script_without_config_prints_usage():
    done = subprocess.run([str(SCRIPTS[0])], capture_output=True, text=True, check=False)
    assert done.returncode == 2 and "usage:" in done.stdout


def _nproc(command: str) -> int:
    words = shlex.split(command)
    return int(words[words.index("--nproc-per-node") + 1])


def test_torchrun_script_starts_engine_ranks_on_the_last_nodes():
    # The 32B async recipe's shape: 4 trainer nodes x 8 ranks, 2 engine nodes x 1 rank.
    shape = {"NNODES": "6", "ENGINE_NODES": "2", "ENGINE_RANKS_PER_NODE": "1"}
    recipe = "examples/deepseek-r1-distill-qwen-32b/train_async.yaml"
    counts = [
        _nproc(_dry_run([str(SCRIPTS[0]), recipe], {**shape, "NODE_RANK": str(node)}))
        for node in range(6)
    ]
    assert counts == [8, 8, 8, 8, 1, 1]
    # without ENGINE_RANKS_PER_NODE, engine nodes start GPUS_PER_NODE ranks like the others
    out = _dry_run(
        [str(SCRIPTS[0]), recipe], {"NNODES": "3", "ENGINE_NODES": "1", "NODE_RANK": "2"}
    )
    assert _nproc(out) == 8


@pytest.mark.parametrize(
    "env,message",
    [
        ({"NNODES": "2", "NODE_RANK": "2"}, "NODE_RANK=2 must lie in 0 .. NNODES-1 = 1"),
        ({"NNODES": "2", "ENGINE_NODES": "2"}, "ENGINE_NODES=2 must leave at least one"),
    ],
)
def test_torchrun_script_refuses_a_shape_that_does_not_fit(env, message):
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    done = subprocess.run(
        [str(SCRIPTS[0]), "examples/deepseek-r1-distill-qwen-7b-tp4-dp4/train_async.yaml"],
        env={**base, "BAPO_DRY_RUN": "1", **env},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.parametrize(
    "recipe,engines,ranks_per_node",
    [
        ("deepseek-r1-distill-qwen-32b/train.yaml", {}, [8, 8, 8]),
        # engine nodes pass through sbatch's and srun's environment to every node's script
        (
            "deepseek-r1-distill-qwen-32b/train_async.yaml",
            {"ENGINE_NODES": "1", "ENGINE_RANKS_PER_NODE": "1"},
            [8, 8, 1],
        ),
    ],
)
def test_slurm_script_starts_one_torchrun_per_node(tmp_path, recipe, engines, ranks_per_node):
    # Stand-ins for srun (runs its command once per node with that node's SLURM_NODEID) and
    # scontrol (expands the node list).
    (tmp_path / "srun").write_text(
        "#!/usr/bin/env bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        "for ((i = 0; i < SLURM_JOB_NUM_NODES; i++)); do "
        'SLURM_NODEID=$i "$@"; done\n'
    )
    (tmp_path / "scontrol").write_text('#!/bin/sh\nprintf "gpu-a\\ngpu-b\\ngpu-c\\n"\n')
    for tool in ("srun", "scontrol"):
        (tmp_path / tool).chmod(0o755)
    env = {
        "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}",
        "SLURM_SUBMIT_DIR": str(REPO_ROOT),
        "SLURM_JOB_NUM_NODES": "3",
        "SLURM_JOB_NODELIST": "gpu-[a-c]",
        "SLURM_JOB_ID": "77",
        **engines,
    }
    out = _dry_run(
        ["bash", str(SCRIPTS[1]), f"examples/{recipe}", "train.steps=2"],
        env,
        cwd=tmp_path,
    )
    commands = [shlex.split(line) for line in out.splitlines() if line.startswith("env ")]
    assert [c[2] for c in commands] == [f"BAPO_NODE_RANK={node}" for node in range(3)]
    # node 0's agent serves the rendezvous, on the first node of the allocation
    hosts = [c[c.index("--rdzv-conf") + 1].split(",")[0] for c in commands]
    assert hosts == ["is_host=true", "is_host=false", "is_host=false"]
    assert [int(c[c.index("--nproc-per-node") + 1]) for c in commands] == ranks_per_node
    for command in commands:
        assert command[command.index("--nnodes") + 1] == "3"
        assert command[command.index("--rdzv-endpoint") + 1] == "gpu-a:20077"
        assert command[command.index("--rdzv-id") + 1] == "bapo-77"
        assert command[command.index("--max-restarts") + 1] == "3"
        assert command[-3:] == ["--config", f"examples/{recipe}", "train.steps=2"]
