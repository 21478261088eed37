"""Elastic gossip with real Gloo processes: SIGKILLed workers are dropped and the survivors train on.

tests/helpers/elastic_worker.py mixes a 4-number replica with exact gossip on one_peer_hypercube, elastic, under
gossip.app.elastic_launch; its update adds a known per-worker delta, so each logged step shows exactly what the
mixing did: nothing (skipped) or the average with its partner (completed). A killed worker dies at the top of its
step, with that step's exchange already posted: the kill lands mid-exchange. Pinned:

* the launcher exits 0; every survivor logs one line naming who left, the step and the new schedule (with the
  fallback of a hypercube over 3 ranks), and records the change;
* every survivor takes every step once; every mixing step between two survivors was applied on both ends or on
  neither; an applied one is the exact average of the two replicas; with the dead worker, a survivor either kept its
  replica or averaged with the dead worker's last replica (its share, nothing else);
* the time from the exit to the new group stays under the documented bound;
* the consensus distance measured between two steps over the worker's group, across the changes, is the exact one
  of the group's replicas;
* two workers killed at once: the two survivors go on, over a 2-rank hypercube; two killed one after the other
  (the second 20 steps after the first, once the first change is complete): two changes, 4 -> 3 -> 2 members;
  two steps apart (while a member may still catch up alone after the first change): one or two changes, the same
  end; a worker killed at the formation of the first change's group, before it arrives there or just after (the
  others already forming the Gloo group wait for it until the group's timeout): the survivors decide again and
  form the next epoch's group, one change naming both;
* a killed worker restarted with the same command joins: it starts at the group's resume step with its donor's
  replica, bit for bit, and from then on every mixing step with it is applied on both ends or neither; also when
  another worker dies while the join is under way;
* a worker frozen mid-run (SIGSTOP: a node that hangs or a network cut, no exit for the launcher to see) is
  declared dead after the membership's silence bound and the rest train on; when it wakes up it learns it was left
  out and ends with a named error;
* the store's host (the launcher) SIGKILLed mid-run: every worker ends within a bounded time with a
  ``MembershipError`` naming the store, none hangs;
* ``--elastic`` with MPI is refused with a named error; ``--kill`` without ``--elastic`` is an argparse error; and
  the main job ``gossip-train --nproc 4 --elastic --kill 2@STEP`` exits 0 with the change in result.json.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import signal
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers.elastic_worker import BETA1, SLOW_SECONDS, delta
from helpers.launch import REPO, python, run_main_job

import gossip
from gossip.app.cli import main
from gossip.app.train import TrainConfig, make_algorithm
from gossip.app.train_elastic import resolve_elastic
from gossip.backends.membership import STORE_VARIABLE
from gossip.errors import ConfigError, ElasticUnsupportedError
from gossip.wrapper.elastic import schedule_for

WORKER = REPO / "tests" / "helpers" / "elastic_worker.py"
#: the documented bound from a reported exit to the new group: the membership's interval plus one group creation,
#: with room for a loaded 2-core machine
BOUND_SECONDS = 5.0
#: the worker's group timeout (tests/helpers/elastic_worker.py): what a death after the others passed the
#: formation's barrier costs on top
GROUP_TIMEOUT = 20.0


def launcher_command(out: Path, n: int, steps: int, kills: str, dead: set[int] | None = None) -> list[str]:
    """The launcher of ``n`` test workers; ``dead`` (default: the killed ones) may die without failing the job."""
    dead = {int(item.split("@")[0]) for item in kills.split(",") if item} if dead is None else dead
    code = (
        "import sys; from gossip.app.elastic_launch import launch_elastic; "
        "say = lambda message: print(message, file=sys.stderr, flush=True); "
        f"sys.exit(launch_elastic({n}, [sys.executable, {str(WORKER)!r}, {str(out)!r}, '{steps}', {kills!r}], "
        f"{dict.fromkeys(dead, 0)!r}, say))"
    )
    return [python(), "-c", code]


ENV = {"PYTHONPATH": f"{REPO}:{REPO / 'tests'}", "PATH": "/usr/bin:/bin"}


def launch(out: Path, n: int, steps: int, kills: str, dead: set[int], env: dict) -> subprocess.CompletedProcess:
    command = launcher_command(out, n, steps, kills, dead)
    return subprocess.run(command, env={**ENV, **env}, capture_output=True, text=True, timeout=200)


def logs(out: Path, suffix: str = "") -> dict[int, list[dict]]:
    paths = [p for p in out.glob(f"rank*{suffix}.jsonl") if p.name.removeprefix("rank").split(".")[0].isdigit()]
    paths = [p for p in paths if p.name.count(".") == 1 + bool(suffix)]
    return {int(p.name[4:].split(".")[0]): [json.loads(line) for line in p.read_text().splitlines()] for p in paths}


def last_rows(out: Path) -> str:
    """Each worker's last logged step and the group it mixed over, for a failure's report."""
    said = []
    for suffix in ("", ".joined"):
        for uid, rows in sorted(logs(out, suffix).items()):
            last = rows[-1] if rows else {}
            said.append(f"worker {uid}{suffix}: last step {last.get('step')} over {last.get('group')}")
    return "; ".join(said)


FORMATION = "ELASTIC_WORKER_DIE_AT_FORMATION"
#: name, workers, steps, kills, the dead, how many changes the survivors may see, environment, bound on the
#: seconds from the first exit to the group the survivors end in
SCENARIOS = [
    ("one", 4, 90, "2@30", {2}, {1}, {}, BOUND_SECONDS),
    ("two", 4, 90, "1@30,3@30", {1, 3}, {1}, {}, BOUND_SECONDS),
    ("successive", 4, 90, "1@30,3@50", {1, 3}, {2}, {}, BOUND_SECONDS),
    ("close", 4, 90, "1@30,3@32", {1, 3}, {1, 2}, {}, BOUND_SECONDS),
    ("formation", 4, 90, "1@30", {1, 3}, {1}, {FORMATION: "3:1:before"}, BOUND_SECONDS),
    ("formation_late", 4, 90, "1@30", {1, 3}, {1}, {FORMATION: "3:1:after"}, BOUND_SECONDS + GROUP_TIMEOUT),
]


@pytest.fixture(scope="module", params=SCENARIOS, ids=lambda p: p[0])
def job(request, tmp_path_factory):
    name, n, steps, kills, dead, changes, env, bound = request.param
    out = tmp_path_factory.mktemp(f"elastic_{name}")
    result = launch(out, n, steps, kills, dead, env)
    return result, logs(out), n, steps, dead, changes, bound


def vector(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def mixing_outcome(rows: dict[int, dict], uid: int, step: int) -> tuple[str, int | None, float]:
    """What the mixing did to ``uid`` at ``step``: ("kept" or "averaged", its partner in the step's group, the
    partner's weight in the schedule of the group's size)."""
    row = rows[step]
    before, mixed = vector(row["before"]), vector(row["after"]) - delta(uid, step)
    group = row["group"]
    schedule, _ = schedule_for("one_peer_hypercube", len(group))
    partners = [(group[p], weight) for p, weight in schedule.peers(group.index(uid), step).in_peers]
    partner, weight = partners[0] if partners else (None, 0.0)
    if torch.allclose(mixed, before, rtol=1e-12, atol=0):
        return "kept", partner, weight
    assert partners, f"member {uid} step {step}: replica changed with no partner"
    return "averaged", partner, weight


@pytest.mark.multiprocess
def test_survivors_finish_and_log_who_left(job):
    result, runs, n, steps, dead, changes, bound = job
    assert result.returncode == 0, result.stdout + result.stderr
    survivors = sorted(set(range(n)) - dead)
    for uid in survivors:
        *rows, last = runs[uid]
        assert [row["step"] for row in rows] == list(range(steps))
        events = last["events"]
        assert len(events) in changes, events
        assert {int(u) for event in events for u in event["left"]} == dead
        assert all(how == "killed by SIGKILL" for event in events for how in event["left"].values())
        assert events[-1]["members"] == survivors
        assert all(event["seconds_since_exit"] < bound for event in events), events
    lines = [line for line in result.stdout.splitlines() if line.startswith("gossip elastic: member")]
    epochs = {int(line.split()[5].rstrip(":")) for line in lines}
    for epoch in epochs:  # one line per member of each new group
        members = {int(line.split()[3].rstrip(":")) for line in lines if f"epoch {epoch}:" in line}
        assert len([line for line in lines if f"epoch {epoch}:" in line]) == len(members)
    assert {int(line.split()[3].rstrip(":")) for line in lines if f"epoch {max(epochs)}:" in line} == set(survivors)
    for uid in dead:
        assert any(f"{uid} (killed by SIGKILL)" in line for line in lines)
    wanted = "base_graph (fallback: one_peer_hypercube over 3 ranks"
    assert all(wanted in line for line in lines if "members [0, 2, 3]" in line or "members [0, 1, 3]" in line)


@pytest.mark.multiprocess
@pytest.mark.parametrize("kill_step", [38, 39])
def test_a_death_in_the_last_steps_ends_every_survivor_in_one_group(tmp_path, kill_step):
    """A worker killed at the run's last step or the one before: survivors that finished their loop before seeing
    the change meet the others at the end, resolve the change and close over one group, instead of failing in their
    final collectives (the worker helper closes its wrapper, a barrier, after the loop)."""
    steps = 40
    result = launch(tmp_path, 4, steps, f"2@{kill_step}", {2}, {})
    errors = {p.name: p.read_text() for p in tmp_path.glob("rank*.error")}
    assert result.returncode == 0 and not errors, f"{errors} {last_rows(tmp_path)}\n{result.stdout}{result.stderr}"
    runs = logs(tmp_path)
    finals = [runs[uid][-1] for uid in (0, 1, 3)]
    assert all([row["step"] for row in runs[uid][:-1]] == list(range(steps)) for uid in (0, 1, 3))
    for final in finals:
        assert final["events"], final
        assert final["events"][-1]["members"] == [0, 1, 3] and final["events"][-1]["left"] == {"2": "killed by SIGKILL"}
    assert len({json.dumps(final["events"][-1]["members"]) for final in finals}) == 1


@pytest.mark.multiprocess
def test_consensus_distance_over_the_group_across_changes(job):
    _, runs, n, steps, dead, _, _ = job
    by_step = {uid: {row["step"]: row for row in runs[uid] if "step" in row} for uid in range(n)}
    measured = 0
    for uid in sorted(set(range(n)) - dead):
        for step, row in by_step[uid].items():
            if row.get("consensus") is None:
                continue
            replicas = torch.stack([vector(by_step[member][step]["after"]) for member in row["group"]])
            expected = (replicas - replicas.mean(0)).square().sum(1).mean().sqrt()
            torch.testing.assert_close(torch.tensor(row["consensus"], dtype=torch.float64), expected, rtol=1e-9,
                                       atol=1e-9)  # fmt: skip
            measured += 1
    after = [
        row for uid in set(range(n)) - dead for s, row in by_step[uid].items() if s > steps - 20 and "consensus" in row
    ]
    assert after and all(row["consensus"] is not None for row in after)  # measured over the survivors at the end
    assert measured >= 10


@pytest.mark.multiprocess
def test_every_mixing_step_is_applied_on_both_ends_or_neither(job):
    _, runs, n, steps, dead, _, _ = job
    check_both_ends_or_neither(runs, n, steps, dead)


def replica_at(rows: dict[int, dict], step: int) -> torch.Tensor | None:
    """A worker's replica at the start of ``step``: logged before it, or after the step before (None: unknown)."""
    if step in rows:
        return vector(rows[step]["before"])
    return vector(rows[step - 1]["after"]) if "after" in rows.get(step - 1, {}) else None


def check_both_ends_or_neither(runs: dict[int, list[dict]], n: int, steps: int, dead: set[int]) -> None:
    """Every mixing step between survivors applied on both ends or neither; with the dead, kept or its share."""
    survivors = sorted(set(range(n)) - dead)
    by_step = {uid: {row["step"]: row for row in runs[uid] if "step" in row} for uid in range(n)}
    checked_with_dead = 0
    for step in range(steps):
        for uid in survivors:
            outcome, partner, weight = mixing_outcome(by_step[uid], uid, step)
            if partner is None:
                continue
            mine = vector(by_step[uid][step]["before"])
            theirs = replica_at(by_step[partner], step)
            if outcome == "averaged":  # exactly the schedule's combination with the partner's replica of this step
                mixed = vector(by_step[uid][step]["after"]) - delta(uid, step)
                torch.testing.assert_close(mixed, mine * (1 - weight) + theirs * weight, rtol=1e-12, atol=0)
            if partner in dead:
                checked_with_dead += 1
                continue
            assert by_step[partner][step]["group"] == by_step[uid][step]["group"] or outcome == "kept"
            other, back, _ = mixing_outcome(by_step[partner], partner, step)
            if outcome == "averaged":
                assert (other, back) == ("averaged", uid), f"step {step}: {uid} averaged with {partner}, not back"
            else:
                assert other == "kept" or back != uid, f"step {step}: {partner} averaged with {uid}, not back"
    assert checked_with_dead >= 1  # the kill step's partner was looked at


@pytest.mark.multiprocess
def tracker_sums_checked(
    by_step: dict[int, dict[int, dict]], inputs: dict[int, dict[int, torch.Tensor]], steps: int
) -> list[tuple[int, tuple[int, ...]]]:
    """Assert that at every step each group's trackers sum to its members' inputs; the (step, group)s checked.

    A group is checked at a step when every member logged that step over that group (not one that died in it).
    """
    checked = []
    for step in range(steps):
        for group in {tuple(rows[step]["group"]) for rows in by_step.values() if step in rows}:
            if not all(step in by_step[uid] and tuple(by_step[uid][step]["group"]) == group for uid in group):
                continue
            total = sum(vector(by_step[uid][step]["tracker"]) for uid in group)
            torch.testing.assert_close(total, sum(inputs[uid][step] for uid in group), rtol=1e-12, atol=1e-9,
                                       msg=f"step {step}, group {group}")  # fmt: skip
            checked.append((step, group))
    return checked


def first_moments(uid: int, steps: int) -> list[torch.Tensor]:
    """MomentumTrackingAdamW's first moment of worker ``uid`` after each step, advanced once a step."""
    h, moments = torch.zeros(4, dtype=torch.float64), []
    for step in range(steps):
        h = h.lerp(-delta(uid, step), 1 - BETA1)
        moments.append(h)
    return moments


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    ("tracking", "kill_in", "optimizer"),
    [("exact", "top", "sgd"), ("exact", "tracker", "sgd"), ("sign", "tracker", "sgd"), ("sign", "tracker", "momentum")],
)
def test_tracked_gradients_keep_their_sum_over_every_group_across_deaths(tmp_path, tracking, kill_in, optimizer):
    """With gradient (or momentum) tracking: at every step, each group's trackers sum to its members' inputs.

    Killed at the top of a step (its parameters' exchange posted), or inside the update, after the parameters'
    mixing and before its trackers' exchange: the partner has mixed the parameters and waits for the trackers.
    Under momentum tracking every survivor's first moment advances exactly once a step, the interrupted one too.
    """
    n, steps, kills, dead = 4, 90, "1@30,3@32", {1, 3}
    env = {
        "ELASTIC_WORKER_TRACKING": tracking,
        "ELASTIC_WORKER_KILL_IN": kill_in,
        "ELASTIC_WORKER_OPTIMIZER": optimizer,
    }
    result = launch(tmp_path, n, steps, kills, dead, env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = logs(tmp_path)
    by_step = {uid: {row["step"]: row for row in runs[uid] if "after" in row} for uid in range(n)}
    if optimizer == "momentum":  # the trackers' input is the first moment; -delta is the gradient
        for uid in (0, 2):
            for step, h in enumerate(first_moments(uid, steps)):
                torch.testing.assert_close(vector(by_step[uid][step]["input"]), h, rtol=1e-12, atol=0,
                                           msg=f"worker {uid} step {step}")  # fmt: skip
                assert by_step[uid][step]["moment_steps"] == step + 1, f"worker {uid} step {step}"
        inputs = {uid: {s: vector(r["input"]) for s, r in rows.items()} for uid, rows in by_step.items()}
    else:
        inputs = {uid: {s: -delta(uid, s) for s in rows} for uid, rows in by_step.items()}
    checked = Counter(len(group) for _, group in tracker_sums_checked(by_step, inputs, steps))
    assert checked.get(4, 0) >= 29 and checked.get(2, 0) >= 40, checked  # before the deaths, and the 2 survivors
    if kill_in == "tracker":  # worker 1's partner at step 30 mixed the parameters with it, then lost the trackers
        (partner, _), *_ = schedule_for("one_peer_hypercube", n)[0].peers(1, 30).in_peers
        row = by_step[partner][30]
        assert row["group"] == [partner]  # the step's remainder ran alone
        if optimizer == "sgd":
            mixed = vector(row["after"]) + vector(row["tracker"])  # SGD with lr 1 stepped on the tracker
            average = (vector(row["before"]) + vector(by_step[1][29]["after"])) / 2
            torch.testing.assert_close(mixed, average, rtol=1e-12, atol=0)
    for uid in (0, 2):
        events = runs[uid][-1]["events"]
        assert {int(u) for event in events for u in event["left"]} == dead and events[-1]["members"] == [0, 2]


@pytest.mark.multiprocess
def test_a_partner_frozen_before_its_trackers_exchange_is_not_waited_for(tmp_path):
    """A change lands between two partners' posts of their trackers' exchange: both run the trackers alone, at once.

    Worker 1 dies at the top of step 30; worker 3 sleeps before it posts its trackers' exchange of that step, so
    the change freezes it after its parameters' exchange only, while its partner already posted both. The decision
    counts the exchanges each posted: the partner skips the trackers' exchange its peer never posted (instead of
    waiting for a message that never comes), worker 3 completes what both posted, and the parameters' mixing of
    step 30, applied on both ends, is kept; the trackers still sum to their inputs in every group.
    """
    n, steps, slow = 4, 60, 3
    (partner, _), *_ = schedule_for("one_peer_hypercube", n)[0].peers(slow, 30).in_peers
    assert partner not in (1, slow)
    env = {"ELASTIC_WORKER_TRACKING": "sign", "ELASTIC_WORKER_SLOW_TRACKER": f"{slow}@30"}
    result = launch(tmp_path, n, steps, "1@30", {1}, env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = logs(tmp_path)
    by_step = {uid: {row["step"]: row for row in runs[uid] if "after" in row} for uid in range(n)}
    inputs = {uid: {s: -delta(uid, s) for s in rows} for uid, rows in by_step.items()}
    checked = Counter(len(group) for _, group in tracker_sums_checked(by_step, inputs, steps))
    assert checked.get(4, 0) >= 29 and checked.get(3, 0) >= 25, checked
    pair = (partner, slow)
    for uid in pair:
        row = by_step[uid][30]
        assert row["group"] == [uid]  # the trackers' exchange ran alone on both ends
        mixed = vector(row["after"]) + vector(row["tracker"])  # SGD with lr 1 stepped on the tracker
        average = sum(vector(by_step[u][30]["before"]) for u in pair) / 2
        torch.testing.assert_close(mixed, average, rtol=1e-12, atol=0)  # the parameters' mixing, on both ends
    outcomes = {uid: runs[uid][-1]["events"][0]["step_outcome"] for uid in pair}
    assert outcomes == {partner: "skipped", slow: "completed"}, outcomes
    took = {uid: by_step[uid][30]["time"] - by_step[uid][29]["time"] for uid in pair}
    assert took[slow] >= SLOW_SECONDS and took[partner] < SLOW_SECONDS / 2, took  # the partner did not wait for it


@pytest.mark.multiprocess
def test_a_change_does_not_wait_for_what_it_interrupted_on_the_old_group(tmp_path):
    """The consensus distance measured after every step: a death interrupts a collective or an exchange that a peer
    never completes, and abandoning the old group does not wait for it until the group's timeout."""
    result = launch(tmp_path, 4, 60, "1@30", {1}, {"ELASTIC_WORKER_CONSENSUS_EVERY": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = logs(tmp_path)
    for uid in (0, 2, 3):
        (event,) = runs[uid][-1]["events"]
        assert event["left"] == {"1": "killed by SIGKILL"} and event["members"] == [0, 2, 3]
        assert event["reform_seconds"] < BOUND_SECONDS < GROUP_TIMEOUT, (uid, event)
        rows = [row for row in runs[uid] if "after" in row]
        assert [row["step"] for row in rows] == list(range(60))
        assert all(row["consensus"] is not None for row in rows if row["step"] < 30 or row["step"] > 31), uid


@pytest.mark.multiprocess
def test_momentum_trackings_sample_is_its_groups_mean_or_skipped_across_deaths(tmp_path):
    """Momentum tracking sampling the mean gradient every 4 steps, workers 1 and 3 killed at the top of steps 30 and
    32: every sample a survivor takes is the mean gradient over a group it was in, the group it trains in when no
    change is under way; a sample a change interrupts is skipped (at most one per change), never taken twice; the
    trackers keep their sum and the first moments advance once a step."""
    n, steps, every, dead = 4, 90, 4, {1, 3}
    env = {
        "ELASTIC_WORKER_TRACKING": "sign",
        "ELASTIC_WORKER_OPTIMIZER": "momentum",
        "ELASTIC_WORKER_SECOND_MOMENT_EVERY": str(every),
    }
    result = launch(tmp_path, n, steps, "1@30,3@32", dead, env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    runs = logs(tmp_path)
    by_step = {uid: {row["step"]: row for row in runs[uid] if "after" in row} for uid in range(n)}
    inputs = {uid: {s: vector(r["input"]) for s, r in rows.items()} for uid, rows in by_step.items()}
    checked = Counter(len(group) for _, group in tracker_sums_checked(by_step, inputs, steps))
    assert checked.get(4, 0) >= 29 and checked.get(2, 0) >= 40, checked
    rate = 0.999**every  # MomentumTrackingAdamW's rate per sample: beta2 to the interval
    for uid in (0, 2):
        rows = by_step[uid]
        for step, h in enumerate(first_moments(uid, steps)):
            torch.testing.assert_close(vector(rows[step]["input"]), h, rtol=1e-12, atol=0)
            assert rows[step]["moment_steps"] == step + 1
        taken = [s for s in range(steps) if rows[s]["samples"] > (rows[s - 1]["samples"] if s else 0)]
        due = [s for s in range(steps) if s % every == 0]
        assert set(taken) <= set(due) and len(due) - len(taken) <= 2, (uid, sorted(set(due) - set(taken)))
        assert rows[steps - 1]["samples"] == len(taken)  # one sample at most a step
        # worker 3 dies before posting step 32's sample: the survivors' is interrupted or refused, and skipped, not
        # taken again alone (no survivor trains alone at a sample step here: the catch-up steps are 30 and 31)
        assert 32 not in taken and all(rows[s]["sampled_over"] >= 2 for s in taken), (uid, taken)
        for step in taken[1:]:
            size = rows[step]["sampled_over"]
            sampled = (vector(rows[step]["shared"]) - rate * vector(rows[step - 1]["shared"])) / (1 - rate)
            groups = [g for g in itertools.combinations(range(n), size) if uid in g]
            means = {g: sum(-delta(u, step) for u in g) / size for g in groups}
            found = [g for g, mean in means.items() if torch.allclose(sampled, mean * mean, rtol=1e-9, atol=0)]
            assert found, f"worker {uid} step {step}: a sample over {size} members that is no group's mean"
            if rows[step]["group"] == rows[step - 1]["group"] == rows[step + 1]["group"]:  # no change under way
                assert found == [tuple(rows[step]["group"])], (uid, step, found)
        assert rows[taken[-1]]["sampled_over"] == 2 and rows[steps - 1]["group"] == [0, 2]


def test_elastic_refuses_mpi_by_name():
    with pytest.raises(ElasticUnsupportedError, match="cannot shrink without ULFM"):
        resolve_elastic(TrainConfig(backend="mpi", algorithm="exact"), 4)


@pytest.mark.parametrize(
    ("option", "settings"),
    [
        ("--algorithm", {"algorithm": "diloco"}),
        ("--average-every", {"algorithm": "exact", "average_every": 8}),
        ("--outer-every", {"algorithm": "powergossip", "outer_every": 10}),
        ("--power-iterations", {"algorithm": "powergossip", "power_iterations": 2}),
        ("--tracking-overlap", {"algorithm": "exact", "gradient_tracking": True, "tracking_overlap": True}),
    ],
)
def test_elastic_refuses_what_needs_every_rank_by_the_option_name(option, settings):
    with pytest.raises(ConfigError, match=f"^{option}: "):
        resolve_elastic(TrainConfig(**settings), 4)


def test_elastic_keeps_momentum_trackings_sample_of_the_mean_gradient():
    settings = {"gradient_tracking": "sign", "optimizer": "momentum-tracking-adamw", "second_moment_every": 64}
    config, _ = resolve_elastic(TrainConfig(**settings), 4)
    assert (config.optimizer, config.second_moment_every) == ("momentum-tracking-adamw", 64)


def test_elastic_runs_the_defaults_without_their_outer_step():
    config, _ = resolve_elastic(TrainConfig(), 4)
    assert (config.algorithm, config.outer_every, config.average_every, config.power_iterations) == (
        "powergossip",
        0,
        0,
        1,
    )
    assert type(make_algorithm(config)) is gossip.PowerGossip


def test_kill_without_elastic_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit):
        main(["--nproc", "2", "--kill", "1@3"])
    assert "--kill: needs --elastic" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_main_job_elastic_kill_exits_zero_and_names_the_change(tmp_path):
    out = tmp_path / "run"
    args = ["--nproc", "4", "--elastic", "--kill", "2@8", "--steps", "16", "--batch-size", "4", "--algorithm",
            "exact", "--eval-every", "100", "--out", str(out)]  # fmt: skip
    result = run_main_job(args, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (event,) = json.loads((out / "result.json").read_text())["membership"]
    assert event["left"] == {"2": "killed by SIGKILL"} and event["members"] == [0, 1, 3]
    # noticed at the kill step or after (how many steps later depends on the machine's load), resumed after it
    assert 8 <= event["noticed_at_step"] <= event["resume_step"] <= 16
    assert "membership: epoch 1: left 2 (killed by SIGKILL)" in result.stdout
    assert (out / "membership.png").stat().st_size > 0  # the curve, marked where the new member set began


@pytest.mark.multiprocess
def test_main_job_elastic_kill_with_sign_momentum_tracking_exits_zero(tmp_path):
    out = tmp_path / "run"
    args = ["--nproc", "4", "--elastic", "--kill", "1@6", "--steps", "14", "--batch-size", "4", "--gradient-tracking",
            "sign", "--optimizer", "momentum-tracking-adamw", "--second-moment-every", "3", "--eval-every", "100",
            "--out", str(out)]  # fmt: skip
    result = run_main_job(args, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((out / "result.json").read_text())
    (event,) = summary["membership"]
    assert event["left"] == {"1": "killed by SIGKILL"} and event["members"] == [0, 2, 3]
    assert math.isfinite(summary["final_train_loss"])


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (not a zombie); a process reaped between the two reads is not alive."""
    try:
        os.kill(pid, 0)
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except (ProcessLookupError, FileNotFoundError):
        return False


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} not within {seconds} s"
        time.sleep(0.05)


@pytest.mark.multiprocess
def test_store_host_death_ends_every_worker_with_a_named_error(tmp_path):
    launcher = subprocess.Popen(launcher_command(tmp_path, 3, 10**6, ""), env=ENV, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)  # fmt: skip
    pids: list[int] = []
    try:
        logs_ready = lambda: all(  # noqa: E731
            (tmp_path / f"rank{r}.jsonl").exists() and len((tmp_path / f"rank{r}.jsonl").read_text().splitlines()) > 20
            for r in range(3)
        )
        _wait_for(logs_ready, 90, "20 steps on every worker")
        pids = [int((tmp_path / f"rank{r}.pid").read_text()) for r in range(3)]
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        _wait_for(lambda: not any(_alive(pid) for pid in pids), 30, "every worker's exit")
        print(f"every worker ended {time.monotonic() - killed:.2f} s after the store's host was killed")
        for r in range(3):
            error = (tmp_path / f"rank{r}.error").read_text()
            assert error.startswith("MembershipError: member ") and "membership store is unreachable" in error
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


def run_with_a_restart(out: Path, steps: int, kills: str, env: dict) -> None:
    """4 workers, ``kills`` killed, worker 2 started again once its death is reported; both must exit 0.

    The others wait at step 60 until the join is asked, so that it lands mid-run.
    """
    hold = {**ENV, **env, "ELASTIC_WORKER_HOLD_AT": "60"}
    launcher = subprocess.Popen(launcher_command(out, 4, steps, kills), env=hold, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        address = next(line for line in launcher.stderr if "membership store at" in line).split()[4]
        said: list[str] = []  # the launcher's messages, kept for a failure's report
        drain = threading.Thread(target=lambda: said.extend(launcher.stderr), daemon=True)
        drain.start()
        joining = {**hold, "RANK": "2", "WORLD_SIZE": "4", STORE_VARIABLE: address, "ELASTIC_WORKER_AFTER_DEATH": "1"}
        joiner = subprocess.run([python(), str(WORKER), str(out), str(steps), ""], env=joining,
                                capture_output=True, text=True, timeout=120)  # fmt: skip
        error = out / "rank2.error"
        assert joiner.returncode == 0, error.read_text() if error.exists() else joiner.stderr[-3000:]
        status = launcher.wait(timeout=120)
        drain.join(timeout=10)
        errors = {path.name: path.read_text() for path in out.glob("rank*.error")}
        assert status == 0, "".join(said)[-4000:] + f"\n{errors}\n{last_rows(out)}"
    finally:
        if launcher.poll() is None:
            launcher.kill()


@pytest.mark.multiprocess
@pytest.mark.parametrize("kills", ["2@20", "2@20,1@61"], ids=["join", "join_during_a_failure"])
def test_restarted_worker_joins_with_its_donors_replica(tmp_path, kills):
    steps = 120
    run_with_a_restart(tmp_path, steps, kills, {})  # worker 1 of the second case dies as the join is under way
    runs = logs(tmp_path)
    *rows, last = logs(tmp_path, ".joined")[2]
    first = rows[0]["step"]
    assert [row["step"] for row in rows] == list(range(first, steps))
    join_event = last["events"][0]
    donor = join_event["joined"]["2"]
    survivors = [0, 3] if "1@" in kills else [0, 1, 3]
    assert join_event["members"][-1] == 2 and join_event["resume_step"] == first  # joiners come last
    assert set(join_event["members"]) <= {0, 1, 2, 3} and set(last["events"][-1]["members"]) == {*survivors, 2}
    donor_row = next(row for row in runs[donor] if row.get("step") == first)
    assert rows[0]["before"] == donor_row["before"]  # the donor's replica at the join, bit for bit
    for uid in survivors:
        events = runs[uid][-1]["events"]
        assert [e["joined"] for e in events if e["joined"]] == [{"2": donor}]
        assert {u for e in events for u in e["left"]} == {"2"} | ({"1"} if "1@" in kills else set())
    by_step = {uid: {row["step"]: row for row in runs[uid] if "step" in row} for uid in survivors}
    by_step[2] = {row["step"]: row for row in rows}
    for step in range(first, steps):
        for uid in (*survivors, 2):
            outcome, partner, _ = mixing_outcome(by_step[uid], uid, step)
            if partner is None or partner not in by_step:  # none, or the worker that died (as in the kills above)
                continue
            other, back, _ = mixing_outcome(by_step[partner], partner, step)
            assert (outcome == "averaged") == (other == "averaged" and back == uid), f"step {step}: {uid}/{partner}"


@pytest.mark.multiprocess
def test_a_restarted_worker_joins_a_tracking_group_and_the_trackers_keep_their_sum(tmp_path):
    """Sign trackers: worker 2 killed at step 20 and restarted joins with zero trackers; the sum holds throughout."""
    steps = 120
    run_with_a_restart(tmp_path, steps, "2@20", {"ELASTIC_WORKER_TRACKING": "sign"})
    runs = logs(tmp_path)
    *rows, last = logs(tmp_path, ".joined")[2]
    by_step = {uid: {row["step"]: row for row in runs[uid] if "after" in row} for uid in range(4)}
    by_step[2].update({row["step"]: row for row in rows})
    inputs = {uid: {step: -delta(uid, step) for step in logged} for uid, logged in by_step.items()}
    first = rows[0]["step"]
    (join_event,) = [event for event in last["events"] if event["joined"]]
    assert join_event["resume_step"] == first and join_event["members"][-1] == 2
    checked = tracker_sums_checked(by_step, inputs, steps)
    assert sum(step < 20 and len(group) == 4 for step, group in checked) == 20  # before the death
    assert sum(step >= first and len(group) == 4 for step, group in checked) == steps - first  # after the join


def _steps_logged(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.mark.multiprocess
def test_a_frozen_worker_is_declared_dead_and_the_rest_train_on(tmp_path):
    steps, detect = 80, 3.0
    env = {**ENV, "ELASTIC_WORKER_DETECT": str(detect)}
    with open(tmp_path / "launcher.out", "w") as out:
        launcher = subprocess.Popen(launcher_command(tmp_path, 4, steps, ""), env=env, stdout=out, stderr=out)
    pid = None
    try:
        _wait_for(lambda: _steps_logged(tmp_path / "rank2.jsonl") > 20, 90, "20 steps on worker 2")
        pid = int((tmp_path / "rank2.pid").read_text())
        os.kill(pid, signal.SIGSTOP)  # no exit, no connection closed: only its silence tells
        finished = lambda: all(  # noqa: E731
            '"events"' in (tmp_path / f"rank{r}.jsonl").read_text() for r in (0, 1, 3)
        )
        _wait_for(finished, 120, "the survivors' last step")
        os.kill(pid, signal.SIGCONT)
        assert launcher.wait(timeout=60) == 1  # worker 2 ended with an error, named below
    finally:
        if pid is not None and _alive(pid):
            os.kill(pid, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()
    error = (tmp_path / "rank2.error").read_text()
    assert error.startswith("MembershipError: member 2: left out of epoch 1 (members [0, 1, 3])"), error
    assert "declared dead while alive; restart this worker" in error
    runs = logs(tmp_path)
    for uid in (0, 1, 3):
        *rows, last = runs[uid]
        assert [row["step"] for row in rows] == list(range(steps))
        (event,) = last["events"]
        assert event["left"] == {"2": f"silent for {detect:.1f} s"} and event["members"] == [0, 1, 3]
        assert event["seconds_since_exit"] is None  # no exit was seen
    check_both_ends_or_neither(runs, 4, steps, {2})
