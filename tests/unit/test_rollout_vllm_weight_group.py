"""The vLLM server client's process-group weight route against a real vLLM server (the optional
vLLM tier): a separately started server's worker joins a gloo group with this process, receives
new weights over it, and then generates with them (log-probs equal a float64 recompute under the
new weights, not the old); a sender cut off part-way leaves the server on its previous weights.
Skipped where vLLM is not installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tests.unit.test_rollout_engines as suite
from bapo_megatron.rollout.embedded.engine import EmbeddedEngine
from bapo_megatron.rollout.protocol import SamplingParams
from bapo_megatron.rollout.vllm.server_client import VLLMServerClient
from tests.unit.test_rollout_vllm import VLLM_MODEL
from tests.unit.test_rollout_vllm_server import ServerProcess

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vllm is not installed (optional tier: requirements-vllm.txt)",
)

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120.0
PARAMS = SamplingParams(max_new_tokens=6, temperature=0.7, seed=3)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A vLLM server started on the seed-0 weights (returned with its URL)."""
    folder = tmp_path_factory.mktemp("vllm-weight-group-model")
    torch.manual_seed(0)
    model = EmbeddedEngine(VLLM_MODEL).model
    model.save_pretrained(folder)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    server = ServerProcess(folder)
    url = server.start().base_url
    yield url, initial
    server.stop()


@pytest.fixture
def vllm_suite(monkeypatch):
    monkeypatch.setattr(suite, "MODEL", VLLM_MODEL)


def group_client(url: str) -> VLLMServerClient:
    return VLLMServerClient.connect(
        url, VLLM_MODEL, weight_transport="process-group", timeout=TIMEOUT_S
    )


def generated_under(client: VLLMServerClient, weights: dict[str, torch.Tensor]) -> None:
    """Generate and check every token's log-prob against a float64 recompute under
    ``weights``."""
    for sample in client.generate(suite.PROMPTS, PARAMS):
        assert len(sample.token_ids) == PARAMS.max_new_tokens
        torch.testing.assert_close(
            torch.tensor(sample.logprobs, dtype=torch.float64),
            suite.teacher_forced(weights, sample, PARAMS.temperature),
            rtol=0,
            atol=2e-5,
        )


def test_vllm_server_generates_with_weights_received_over_the_group(served, vllm_suite):
    url, initial = served
    client = group_client(url)
    assert client.weight_group.server_ranks == 1
    generated_under(client, initial)  # the seed-0 folder the server started from
    for version, seed in ((1, 7), (2, 8)):
        new = suite.random_weights(seed)
        client.update_weights(new.items(), version=version)
        samples = client.generate(suite.PROMPTS, PARAMS)
        assert all(s.versions == [version] * PARAMS.max_new_tokens for s in samples)
        generated_under(client, new)
        old = suite.teacher_forced(initial, samples[0], PARAMS.temperature)
        gap = (torch.tensor(samples[0].logprobs, dtype=torch.float64) - old).abs().max()
        assert gap > 1e-3  # the check above tells the weights apart
    assert client.weight_group.group_name is not None  # one group served both updates


CUT_SENDER = """
import os, sys
import torch
import tests.unit.test_rollout_engines as suite
from tests.unit.test_rollout_vllm import VLLM_MODEL
from bapo_megatron.rollout.vllm.server_client import VLLMServerClient
from bapo_megatron.rollout.weight_group import ServerWeightGroup

def first_then_die(self, tensors):
    options = torch.distributed.BroadcastOptions()
    options.rootRank = 0
    self.group.broadcast([tensors[0]], options).wait()
    os._exit(17)  # the trainer dies part-way through the update

suite.MODEL = VLLM_MODEL
ServerWeightGroup._broadcast = first_then_die
client = VLLMServerClient.connect(
    sys.argv[1], VLLM_MODEL, weight_transport="process-group", timeout=120
)
client.update_weights(suite.random_weights(9).items(), version=9)
"""


def test_a_cut_update_leaves_the_vllm_server_on_its_previous_weights(served, vllm_suite):
    url, _ = served
    client = group_client(url)
    held = suite.random_weights(5)
    client.update_weights(held.items(), version=1)
    cut = subprocess.run(
        [sys.executable, "-c", CUT_SENDER, url],
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert cut.returncode == 17, cut.stderr[-3000:]
    generated_under(client, held)
    # the cut sender's group replaced this client's on the server: the next update builds anew
    fresh = group_client(url)
    new = suite.random_weights(6)
    fresh.update_weights(new.items(), version=2)
    generated_under(fresh, new)
