"""Draw the step graphs of a schedule with matplotlib (imported lazily, Agg backend)."""

from __future__ import annotations

import math
import os

import networkx as nx

from topologies.schedule import Schedule

MAX_PANELS = 8
MAX_LABELLED_EDGES = 24


def draw_schedule(schedule: Schedule, path: str | os.PathLike, *, steps: int | None = None) -> list[int]:
    """Save one panel per step of ``schedule`` to the image file ``path``.

    Ranks sit on a circle; an arrow j -> i means i receives x_j, labelled by W[i, j] when the step has at most
    MAX_LABELLED_EDGES edges; symmetric schedules are drawn undirected. Needs matplotlib (imported here, with the
    Agg backend).

    Args:
        schedule: the schedule to draw.
        path: the image file to write; matplotlib picks the format from its suffix (e.g. ``.png``).
        steps: how many steps to draw, from step 0; None draws one period (the first ``window`` steps when
            aperiodic), at most MAX_PANELS of them.

    Returns:
        The steps drawn, 0 .. count - 1.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    count = min(len(schedule.check_steps), MAX_PANELS) if steps is None else steps
    drawn = list(range(count))
    cols = min(4, count)
    rows = math.ceil(count / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.2 * cols, 3.2 * rows), squeeze=False)
    positions = nx.circular_layout(range(schedule.n))
    for ax in axes.ravel():
        ax.set_axis_off()
    for t, ax in zip(drawn, axes.ravel(), strict=False):
        graph = schedule.graph(t)
        graph.remove_edges_from(list(nx.selfloop_edges(graph)))
        if schedule.is_symmetric:
            graph = graph.to_undirected()
        arrows = {"arrowsize": 8, "connectionstyle": "arc3,rad=0.08"} if graph.is_directed() else {}
        nx.draw_networkx(graph, positions, ax=ax, node_size=180, font_size=7, **arrows)
        if graph.number_of_edges() <= MAX_LABELLED_EDGES:
            labels = {(u, v): f"{w:.2g}" for u, v, w in graph.edges(data="weight")}
            nx.draw_networkx_edge_labels(graph, positions, labels, ax=ax, font_size=5, label_pos=0.3)
        ax.set_title(f"{schedule.name} t={t}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return drawn
