"""Worker for tests/test_rendezvous.py: ``gossip.init("gloo", timeout)`` with the environment the test gives,
then an all_reduce of ones and ``close``; prints ``joined <sum>`` on success."""

import sys

import torch

import gossip

comm = gossip.init("gloo", timeout=float(sys.argv[1]))
ones = torch.ones(1)
comm.all_reduce(ones)
print(f"joined {ones.item():g}", flush=True)
comm.close()
