"""Topologies at n = 16, 32, 64: steps to consensus of every schedule, and a decentralized SGD toy (simulator).

* :mod:`experiments.topologies.study` -- the study and its tables (``python -m experiments.topologies``).
"""
