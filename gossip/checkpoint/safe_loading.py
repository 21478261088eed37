"""What a weights-only load (``torch.load(weights_only=True)``) accepts: the allow-list of the project's own
globals, the first object of a state that such a load would refuse, and the line of torch's refusal to quote."""

from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Any

import torch

#: Globals of the project's own state that a weights-only load must accept beyond torch's defaults. Empty: the
#: state is converted to plain data at save time (RNG states to tensors, ints and tuples).
SAFE_GLOBALS: list[Any] = []
_PLAIN = (int, float, bool, str, bytes, bytearray, complex, type(None), torch.dtype, torch.device, torch.Size)


def first_unsafe_item(obj: Any, where: str) -> tuple[str, str] | None:
    """The first object in ``obj`` that ``torch.load(weights_only=True)`` refuses, or None.

    Args:
        obj: the state to inspect.
        where: how the path to ``obj`` is written in the result (e.g. ``"state"``).

    Returns:
        ``(where, type)`` of that object, or None when everything is plain data.
    """
    kind = type(obj)
    if kind in _PLAIN or kind in (torch.Tensor, torch.nn.Parameter) or kind in SAFE_GLOBALS:
        return None
    if kind in (dict, OrderedDict, Counter):
        for key, value in obj.items():
            found = first_unsafe_item(key, f"{where} key {key!r}") or first_unsafe_item(value, f"{where}[{key!r}]")
            if found:
                return found
        return None
    if kind in (list, tuple, set):
        for index, value in enumerate(obj):
            found = first_unsafe_item(value, f"{where}[{index}]")
            if found:
                return found
        return None
    return where, f"{kind.__module__}.{kind.__qualname__}"


def weights_only_refusal(error: Exception) -> str:
    """The line of torch's weights-only refusal that names the global it refused (else its first line).

    Args:
        error: torch's ``UnpicklingError``.

    Returns:
        That line.
    """
    text = str(error)
    line = next((line.strip() for line in text.splitlines() if "GLOBAL" in line), text.splitlines()[0])
    return line
