"""GraVAC-style adaptive PowerGossip rank vs fixed ranks, i.i.d. and non-i.i.d. (simulator, 4 workers).

* :mod:`experiments.adaptive_rank.study` -- the runs, table and plot (``python -m experiments.adaptive_rank``).
"""
