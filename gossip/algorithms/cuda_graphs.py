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
Capture is thread-local (``capture_error_mode="thread_local"``), so virtual ranks of the simulator that share one
GPU from several threads may capture at the same time.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from gossip.errors import ConfigurationError

_WARMED = object()  # the table's mark for a key that ran once eagerly and is captured at its next call


class CapturedKernels:
    """Runs keyed kernel sequences on one CUDA device eagerly once, then as CUDA graphs.

    Args:
        device: the CUDA device the sequences run on.
        owner: named in the error raised when a capture fails (e.g. ``"rank 3: PowerGossip"``).
        hint: what to do when a capture fails, appended to that error.
    """

    def __init__(self, device: torch.device, owner: str, hint: str):
        self.device = device
        self.owner = owner
        self.hint = hint
        self.stream = torch.cuda.Stream(device)
        self.captured = 0  # graphs captured so far

    def run(self, table: dict, key: Hashable, sequence: Callable[[], None]) -> None:
        """Run ``sequence`` (kernels only, no host synchronisation) as the stage of ``key`` in ``table`` says.

        Args:
            table: where the graphs of one set of tensors live (their lifetime is the tensors').
            key: which sequence of that set.
            sequence: launches the kernels; called eagerly at the first call and while capturing at the second.

        Raises:
            ConfigurationError: the capture failed (an operation in ``sequence`` cannot be captured).
        """
        graph = table.get(key)
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
        except RuntimeError as error:
            raise ConfigurationError(
                f"{self.owner}: capturing its kernels {key!r} as a CUDA graph failed ({error}); {self.hint}"
            ) from error
        table[key] = graph
        self.captured += 1
        graph.replay()
