"""Suite-wide settings: one intra-op thread per process.

With 2 cores shared by several processes, torch's default thread pool oversubscribes them and single tests slow
down by an order of magnitude; the multiprocess workers set the same through OMP_NUM_THREADS.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
