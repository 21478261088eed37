"""The sharded-layout refusals that need no process group (tests/test_sharded.py covers the rest in its job)."""

from __future__ import annotations

import pytest
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel

from gossip.errors import ShardedLayoutError
from gossip.wrapper.shard_layout import check_sharded_module, refuse_sharded


def _with_fsdp1() -> nn.Module:
    """A model holding an FSDP1 module; building a real one needs an accelerator and a process group, and the
    checks look only at its type, so it is created without running FSDP1's constructor."""
    legacy = FullyShardedDataParallel.__new__(FullyShardedDataParallel)
    nn.Module.__init__(legacy)
    net = nn.Sequential(nn.Linear(4, 3))
    net.add_module("legacy", legacy)
    return net


@pytest.mark.parametrize("check", [lambda m: check_sharded_module(m, [0, 1], 0), lambda m: refuse_sharded(m, 0)])
def test_fsdp1_flat_shards_are_refused_by_both_wrappers_naming_the_module_and_fsdp2(check):
    with pytest.raises(ShardedLayoutError, match=r"rank 0: 'legacy' is FSDP1.*flat shards.*fully_shard"):
        check(_with_fsdp1())


def test_a_plain_model_is_refused_as_sharded_replicas_naming_the_parameter():
    with pytest.raises(ShardedLayoutError, match=r"rank 0: parameter '0.weight' is not sharded.*fully_shard"):
        check_sharded_module(nn.Sequential(nn.Linear(4, 3)), [0, 1], 0)
