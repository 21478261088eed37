"""gossip-train: decentralized (gossip) data-parallel training for PyTorch.

``gossip.init()`` returns a communicator for however this process was launched; ``gossip.simulate(n, fn)`` runs
``fn(comm)`` on ``n`` in-process virtual ranks, the oracle every real backend is tested against.
"""

__version__ = "0.1.0"

from gossip.algorithms import (
    ALGORITHMS,
    AdaptivePowerGossip,
    Algorithm,
    AllReduce,
    DiLoCo,
    ExactGossip,
    HierarchicalGossip,
    PeriodicAverage,
    PowerGossip,
    Traffic,
    exclude_names,
    tagc_policy,
)
from gossip.backends.base import Communicator, Handle
from gossip.backends.simulator import SimulatorCommunicator, simulate
from gossip.bootstrap import BACKENDS, init
from gossip.checkpoint import CheckpointFuture, CheckpointMismatchError, load_checkpoint, save_checkpoint
from gossip.errors import (
    BackendUnavailableError,
    CheckpointError,
    CheckpointWriteError,
    CommTimeoutError,
    ExchangeMismatchError,
    GossipError,
    LaunchError,
    NonFiniteError,
    NonFiniteWarning,
    PeerFailedError,
    UntrustedCheckpointError,
)
from gossip.launch_env import LaunchInfo, detect_launch
from gossip.parallel import DecentralizedDataParallel
from gossip.replicas import ReplicaMismatchError

__all__ = [
    "ALGORITHMS",
    "BACKENDS",
    "AdaptivePowerGossip",
    "Algorithm",
    "AllReduce",
    "BackendUnavailableError",
    "CheckpointError",
    "CheckpointFuture",
    "CheckpointMismatchError",
    "CheckpointWriteError",
    "CommTimeoutError",
    "Communicator",
    "DecentralizedDataParallel",
    "DiLoCo",
    "ExactGossip",
    "ExchangeMismatchError",
    "GossipError",
    "Handle",
    "HierarchicalGossip",
    "LaunchError",
    "LaunchInfo",
    "NonFiniteError",
    "NonFiniteWarning",
    "PeerFailedError",
    "PeriodicAverage",
    "PowerGossip",
    "ReplicaMismatchError",
    "SimulatorCommunicator",
    "Traffic",
    "UntrustedCheckpointError",
    "__version__",
    "detect_launch",
    "exclude_names",
    "init",
    "load_checkpoint",
    "save_checkpoint",
    "simulate",
    "tagc_policy",
]
