"""Gossip algorithms behind one start/finish interface: ExactGossip, PowerGossip, ChocoSign, AllReduce,
HierarchicalGossip, AdaptivePowerGossip; the PeriodicAverage wrapper; the OuterOptimizer and the DiLoCo baseline,
one case of it; compression policies (``tagc_policy``)."""

from gossip.algorithms.adaptive_rank import AdaptivePowerGossip, LadderSearch
from gossip.algorithms.allreduce import AllReduce
from gossip.algorithms.base import Algorithm, Traffic
from gossip.algorithms.choco_sign import ChocoSign
from gossip.algorithms.diloco import DiLoCo
from gossip.algorithms.exact import ExactGossip
from gossip.algorithms.hierarchical import HierarchicalGossip
from gossip.algorithms.outer import OuterOptimizer
from gossip.algorithms.periodic import PeriodicAverage
from gossip.algorithms.powergossip import PowerGossip, PowerGossipTuning, exclude_names
from gossip.algorithms.presets import tagc_policy

ALGORITHMS = {"exact": ExactGossip, "powergossip": PowerGossip, "allreduce": AllReduce, "diloco": DiLoCo}

__all__ = [
    "ALGORITHMS",
    "AdaptivePowerGossip",
    "Algorithm",
    "AllReduce",
    "ChocoSign",
    "DiLoCo",
    "ExactGossip",
    "HierarchicalGossip",
    "LadderSearch",
    "OuterOptimizer",
    "PeriodicAverage",
    "PowerGossip",
    "PowerGossipTuning",
    "Traffic",
    "exclude_names",
    "tagc_policy",
]
