"""Fixed sequences of CUDA kernels launched as one CUDA graph: the host issues one launch instead of one per kernel.

PowerGossip's work between two exchanges of an edge is the same sequence of kernels on the same tensors at every
step (its plans hold every buffer and view, :class:`gossip.algorithms.powergossip_layout.Plan`), and at the sizes of
its factors the host's launches, not the kernels, bound its time on a GPU. :class:`CapturedKernels` runs such a
sequence, named by a key in a per-plan table, in three stages:

1. first call: eagerly, on the capture stream (libraries such as cuBLAS set up their per-stream workspaces there,
   which a capture cannot do);
2. second call: captured into a ``torch.cuda.CUDAGraph`` (nothing runs while capturing), then replayed once;
3. every later call: replayed, on the current stream, ordered with the work before and after it as a kernel is.

A graph reads and writes the tensors it was captured with, so the sequence must touch only tensors that live as
long as the table (a plan's buffers, the parameters' bucket views, the edge's factors, which change in place) and
run no host synchronisation. The temporaries of the captured kernels live in the graph's private memory pool.

A capture runs nothing, so a capture that fails (another thread of the process synchronised the device meanwhile,
which invalidates it, or an operation cannot be captured) changes nothing either: the sequence then runs eagerly,
now and at every later call of that key, with one :class:`CudaGraphWarning` naming the key and the cause.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Hashable

import torch

from gossip.errors import CudaGraphWarning

_WARMED = object()  # the table's mark for a key that ran once eagerly and is captured at its next call
_EAGER = object()  # the table's mark for a key whose capture failed: it runs eagerly from then on


class CapturedKernels:
    """Runs keyed kernel sequences on one CUDA device eagerly once, then as CUDA graphs.

    Args:
        device: the CUDA device the sequences run on.
        owner: named in the warning given when a capture fails (e.g. ``"rank 3: PowerGossip"``).
        hint: what to do about it, appended to that warning.
    """

    def __init__(self, device: torch.device, owner: str, hint: str):
        self.device = device
        self.owner = owner
        self.hint = hint
        self.stream = torch.cuda.Stream(device)
        self.captured = 0  # graphs captured so far
        self.failed = 0  # captures that failed (their sequences run eagerly)

    def run(self, table: dict, key: Hashable, sequence: Callable[[], None]) -> None:
        """Run ``sequence`` (kernels only, no host synchronisation) as the stage of ``key`` in ``table`` says.

        Args:
            table: where the graphs of one set of tensors live (their lifetime is the tensors').
            key: which sequence of that set.
            sequence: launches the kernels; called eagerly at the first call and while capturing at the second.

        Warns:
            CudaGraphWarning: the capture failed; ``sequence`` ran eagerly and will at every later call of ``key``.
        """
        graph = table.get(key)
        if graph is _EAGER:
            sequence()
            return
        if graph is not None and graph is not _WARMED:
            graph.replay()
            return
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        if graph is None:
            with torch.cuda.stream(self.stream):
                sequence()
            current.wait_stream(self.stream)
            table[key] = _WARMED
            return
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, stream=self.stream, capture_error_mode="thread_local"):
                sequence()
        except RuntimeError as error:  # nothing ran while capturing: run it now, and op by op from now on
            table[key] = _EAGER
            self.failed += 1
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            warnings.warn(
                f"{self.owner}: capturing its kernels {key!r} as a CUDA graph failed ({first_line}); they run "
                f"one by one from now on, with the same results; {self.hint}",
                CudaGraphWarning,
                stacklevel=3,
            )
            sequence()
            return
        table[key] = graph
        self.captured += 1
        graph.replay()
