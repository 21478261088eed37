"""TAGC: which layers PowerGossip should compress (simulator, 4 workers).

* :mod:`experiments.layer_selection.study` -- the runs, table and plot (``python -m experiments.layer_selection``).
"""
