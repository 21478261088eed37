"""The Lightning strategy and the HF Trainer on a GPU, as their users write it. Skipped where no CUDA device exists.

tests/helpers/device_integrations_worker.py trains each for a few steps in one process on one GPU (a world of one:
two NCCL ranks cannot share a GPU, the 2- and 4-process runs are the CPU tests'), with bf16 mixed precision and a
module that returns ``torch.optim.AdamW``: the parameters live on the GPU, gossip's communicator is NCCL, the
optimizer is the default pipeline's, and the loss goes down. ``GOSSIP_TEST_DEVICE=cpu`` runs it on the CPU (Gloo)
to check the test itself without a GPU.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("pytorch_lightning")
pytest.importorskip("transformers")

from helpers.launch import TEST_DEVICE, device_job

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(TEST_DEVICE == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return device_job("device_integrations_worker.py", tmp_path_factory.mktemp("device-integrations"))


@pytest.mark.parametrize("integration", ["lightning", "hf"])
def test_each_integration_trains_the_default_pipeline_on_the_device_with_gossip_on_its_backend(runs, integration):
    run = runs[integration]
    backend = "nccl" if TEST_DEVICE == "cuda" else "gloo"
    assert (run["parameters"], run["optimizer"], run["backend"], run["wrapper"]) == (
        [TEST_DEVICE],
        "MomentumTrackingAdamW",
        backend,
        "DecentralizedDataParallel",
    )


@pytest.mark.parametrize("integration", ["lightning", "hf"])
def test_each_integrations_loss_goes_down_under_bf16_mixed_precision(runs, integration):
    losses = runs[integration]["losses"]
    assert len(losses) >= 10
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
