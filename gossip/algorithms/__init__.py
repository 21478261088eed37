"""Gossip algorithms behind one start/finish interface: ExactGossip, PowerGossip, AllReduce."""

from gossip.algorithms.allreduce import AllReduce
from gossip.algorithms.base import Algorithm, Traffic
from gossip.algorithms.exact import ExactGossip
from gossip.algorithms.powergossip import PowerGossip, exclude_names

ALGORITHMS = {"exact": ExactGossip, "powergossip": PowerGossip, "allreduce": AllReduce}

__all__ = ["ALGORITHMS", "Algorithm", "AllReduce", "ExactGossip", "PowerGossip", "Traffic", "exclude_names"]
