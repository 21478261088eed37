"""The exit guard's excepthook stays one link of the chain when process groups are created again and again.

``init_process_group`` wraps whatever ``sys.excepthook`` is at that moment (torch's ``_distributed_excepthook``
calls the hook it found). Elastic training creates one group per membership epoch, and every communicator is
registered with the guard: re-installing the guard's hook over torch's wrapper of it closed a cycle (guard ->
wrapper -> guard ...), and an uncaught exception in a worker ended in ``RecursionError`` instead of its traceback.
"""

from __future__ import annotations

import sys

import pytest

from gossip.backends import exit_guard


class ClosedComm:
    """A communicator the guard watches that is closed and healthy: the hook only prints (no exit)."""

    failure = None
    _closed = True


def torch_like_wrapper(calls: list[str]):
    """What init_process_group installs: a hook that calls the hook in place when it was installed."""
    old_hook = sys.excepthook

    def _distributed_excepthook(*args):
        calls.append("wrapper")
        old_hook(*args)

    return _distributed_excepthook


@pytest.fixture
def clean_hooks(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(sys, "excepthook", lambda *args: calls.append("original"))
    monkeypatch.setattr(exit_guard, "_previous_hook", None)
    monkeypatch.setattr(exit_guard, "_watched", [])
    monkeypatch.setattr(exit_guard, "_atexit_registered", True)  # no atexit handler from a test
    return calls


def test_groups_created_again_keep_one_guard_in_the_chain(clean_hooks):
    for _ in range(3):  # three epochs: a group (torch wraps the hook), then its communicator (the guard)
        sys.excepthook = torch_like_wrapper(clean_hooks)
        exit_guard.watch(ClosedComm())
    error = RuntimeError("boom")
    sys.excepthook(RuntimeError, error, None)  # a RecursionError here before the fix
    assert clean_hooks == ["wrapper", "wrapper", "wrapper", "original"]  # each wrapper once, the guard once between


def test_a_foreign_hook_installed_later_is_kept_under_the_guard(clean_hooks):
    exit_guard.watch(ClosedComm())
    sys.excepthook = lambda *args: clean_hooks.append("user")  # does not call the guard
    exit_guard.watch(ClosedComm())
    assert sys.excepthook is exit_guard._hook
    sys.excepthook(RuntimeError, RuntimeError("boom"), None)
    assert clean_hooks == ["user"]
