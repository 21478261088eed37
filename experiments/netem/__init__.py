"""Network emulation for experiments: N hosts in network namespaces with per-host rate limits and delay.

See README.md in this directory. Needs root.
"""

from experiments.netem.cleanup import cleanup_stale
from experiments.netem.config import NetemConfigError, NetworkConfig, parse_rate_limit
from experiments.netem.network import EmulatedNetwork, NetemUnavailable, missing_prerequisites

__all__ = [
    "EmulatedNetwork",
    "NetemConfigError",
    "NetemUnavailable",
    "NetworkConfig",
    "cleanup_stale",
    "missing_prerequisites",
    "parse_rate_limit",
]
