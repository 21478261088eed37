"""gossip-train: decentralized (gossip) data-parallel training for PyTorch.

``gossip.init()`` returns a communicator for however this process was launched; ``gossip.simulate(n, fn)`` runs
``fn(comm)`` on ``n`` in-process virtual ranks, the oracle every real backend is tested against.
"""

from gossip.algorithms import ALGORITHMS, Algorithm, AllReduce, ExactGossip, PowerGossip, Traffic, exclude_names
from gossip.backends.base import Communicator, Handle
from gossip.backends.simulator import SimulatorCommunicator, simulate
from gossip.bootstrap import BACKENDS, init
from gossip.errors import (
    BackendUnavailableError,
    CommTimeoutError,
    ExchangeMismatchError,
    GossipError,
    LaunchError,
    PeerFailedError,
)
from gossip.launch_env import LaunchInfo, detect_launch

__all__ = [
    "ALGORITHMS",
    "BACKENDS",
    "Algorithm",
    "AllReduce",
    "BackendUnavailableError",
    "CommTimeoutError",
    "Communicator",
    "ExactGossip",
    "ExchangeMismatchError",
    "GossipError",
    "Handle",
    "LaunchError",
    "LaunchInfo",
    "PeerFailedError",
    "PowerGossip",
    "SimulatorCommunicator",
    "Traffic",
    "detect_launch",
    "exclude_names",
    "init",
    "simulate",
]
