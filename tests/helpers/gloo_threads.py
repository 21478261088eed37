"""The Gloo threads of this process, as the clean-exit tests count them (Linux: ``/proc/self/task``).

``dist.destroy_process_group`` returns while Gloo's I/O loop thread may still be exiting: the last reference to its
device can be dropped on another Gloo thread, which joins the loop there, shortly afterwards. A group that is
still referenced keeps its threads until interpreter exit, which is what the tests must catch; so they wait, up to a
deadline far longer than that exit, for the Gloo threads to end before they read what is left.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

GLOO_THREADS = ("pt_gloo_runloop", "gloo_tcp_loop", "pt_tcpstore_uv")  # workers, I/O loop, rendezvous server


def thread_names() -> list[str]:
    """The names of this process's threads that are alive; one that ends while they are listed is left out."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except FileNotFoundError:  # the thread ended between the listing and the read
            continue
    return names


def gloo_threads() -> list[str]:
    """The names of this process's Gloo threads that are alive."""
    return [name for name in thread_names() if name in GLOO_THREADS]


def thread_names_once_gloo_ended(deadline_seconds: float = 5.0) -> list[str]:
    """This process's thread names once none of them is a Gloo thread, or at the deadline (whatever is left then).

    Args:
        deadline_seconds: how long the Gloo threads get to end.

    Returns:
        The names of the threads alive when the wait ended.
    """
    end = time.monotonic() + deadline_seconds
    names = thread_names()
    while set(names) & set(GLOO_THREADS) and time.monotonic() < end:
        time.sleep(0.005)
        names = thread_names()
    return names


def gossip_and_gloo_threads(baseline: collections.Counter | None = None, deadline: float = 5.0) -> collections.Counter:
    """This process's gossip and Gloo threads; with ``baseline``, waited for (up to ``deadline``) to equal it."""
    end = time.monotonic() + deadline
    while True:
        names = collections.Counter(n for n in thread_names() if n in GLOO_THREADS or n.startswith("gossip"))
        if baseline is None or names == baseline or time.monotonic() > end:
            return names
        time.sleep(0.05)
