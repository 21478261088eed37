"""The NCCL path's background checks, without a GPU: an exchange whose steady header disagrees is named when the
communication thread completes it, and one that never completes on the GPU ends in a timeout naming its peers."""

from __future__ import annotations

import time

import pytest
import torch

from gossip.backends.torch_dist import TorchDistCommunicator
from gossip.backends.wire import Transfer, steady_header
from gossip.errors import CommTimeoutError, ExchangeMismatchError


class Event:
    """Stands in for a CUDA event recorded after an exchange's transfers."""

    def __init__(self, complete: bool):
        self.complete = complete

    def query(self) -> bool:
        return self.complete


def pending_exchange(complete: bool, their_seq: int) -> TorchDistCommunicator:
    comm = TorchDistCommunicator.__new__(TorchDistCommunicator)  # the checks need no process group
    comm.rank, comm.timeout = 0, 0.2
    sends, recvs = [Transfer(1, torch.zeros(3), 0, 1)], [Transfer(1, torch.zeros(3), 0, 1)]
    theirs = torch.tensor(steady_header(their_seq, recvs, sends))  # what peer 1 sent at its exchange
    deadline = time.monotonic() + 0.2  # posted just now with a 0.2 s timeout
    comm._pending = [(Event(complete), deadline, 5, [1], [(1, theirs, sends, recvs)])]
    return comm


def test_a_completed_exchange_with_a_matching_header_passes():
    comm = pending_exchange(complete=True, their_seq=5)
    comm._check_pending()
    assert comm._pending == []


def test_a_peer_at_another_step_is_named_when_the_exchange_completes():
    with pytest.raises(ExchangeMismatchError, match=r"rank 0: exchange 5: message from peer 1 belongs to exchange 6"):
        pending_exchange(complete=True, their_seq=6)._check_pending()


def test_an_exchange_that_never_completes_on_the_gpu_times_out_naming_its_peer():
    with pytest.raises(
        CommTimeoutError, match=r"rank 0: exchange 5 timed out after 0.2 s: the transfers with peer\(s\) \[1\] did not"
    ):
        pending_exchange(complete=False, their_seq=5)._check_pending()
