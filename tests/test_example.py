"""examples/train_lifecycle.py, the user guide's whole-run example, runs as documented and resumes bit for bit.

The user guide (docs/guide/loop.md) also lists the schedules that accept a world of one; the list must be exact.
And the README's loop, copied as printed after a model and a loader exist, trains two ranks under torchrun.

Two ranks: one uninterrupted run, and one stopped after step 70 (mid-epoch, in the second epoch) by ``--stop-at``
then restarted with the same command. The restart runs under ``mpiexec`` (MPI backend) although the checkpoint was
written under torchrun (Gloo): the backends compute the same bits, so the resumed run must end with exactly the
uninterrupted run's averaged model and validation losses.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.launch import CPU_ONLY, REPO, _env, mpiexec, python

import topologies

EXAMPLE = REPO / "examples" / "train_lifecycle.py"
N = 2
ARGS = ["--steps", "80", "--eval-every", "40", "--checkpoint-every", "30"]


def run(launcher: str, cwd: Path, *args: str) -> str:
    if launcher == "torchrun":
        command = [python(), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={N}"]
    else:
        command = [mpiexec(), "-n", str(N), python()]
    job = subprocess.run([*command, str(EXAMPLE), *ARGS, *args], cwd=cwd, env=_env(CPU_ONLY), capture_output=True,
                         text=True, timeout=180)  # fmt: skip
    assert job.returncode == 0, job.stdout + job.stderr
    return job.stdout


def evaluations(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("step ")]


@pytest.mark.multiprocess
def test_example_stopped_and_resumed_ends_bit_identical_to_the_uninterrupted_run(tmp_path):
    straight = run("torchrun", tmp_path, "--out", "straight")
    first = run("torchrun", tmp_path, "--checkpoint-dir", "ckpt", "--stop-at", "70", "--out", "resumed")
    second = run("mpiexec", tmp_path, "--checkpoint-dir", "ckpt", "--out", "resumed")
    assert f"{N} rank(s), starting at step 0 of 80" in first
    assert f"{N} rank(s), starting at step 70 of 80" in second
    assert evaluations(first) + evaluations(second) == evaluations(straight) != []
    expected = torch.load(tmp_path / "straight" / "model.pt")
    got = torch.load(tmp_path / "resumed" / "model.pt")
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[name], got[name]) for name in expected)


def test_the_schedules_the_user_guide_says_accept_a_world_of_one_are_exactly_those():
    text = " ".join((REPO / "docs" / "guide" / "loop.md").read_text().split())
    sentence = re.search(r"The schedules that accept n = 1 are (.*?)\.", text)
    assert sentence is not None
    listed = set(re.findall(r"`(\w+)`", sentence.group(1)))
    accepting = set()
    for name in topologies.names():
        try:
            topologies.by_name(name, 1)
        except (ValueError, topologies.ScheduleError):
            continue
        accepting.add(name)
    assert listed == accepting


LOOP_PRELUDE = """\
import torch
model = torch.nn.Linear(8, 4)
data = torch.Generator().manual_seed(0)
loader = [(torch.randn(16, 8, generator=data), torch.randint(0, 4, (16,), generator=data)) for _ in range(6)]
"""
LOOP_CODA = """
with model.averaged() as average:  # one file per rank: torchrun interleaves the ranks' stdout mid-line
    with open(f"rank{comm.rank}.txt", "w") as out:
        out.write(f"rank {comm.rank}: {len(loader)} steps, averaged weight norm {average.weight.norm():.4f}")
"""


@pytest.mark.multiprocess
def test_the_readmes_loop_trains_two_ranks_as_printed(tmp_path):
    readme = (REPO / "README.md").read_text()
    block = re.search(r"## Use it in your own loop\n\n```python\n(.*?)```", readme, re.DOTALL)
    assert block is not None, "the README's loop is its first python block under 'Use it in your own loop'"
    script = tmp_path / "loop.py"
    script.write_text(LOOP_PRELUDE + block.group(1) + LOOP_CODA)
    command = [python(), "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={N}", str(script)]
    job = subprocess.run(command, cwd=tmp_path, env=_env(CPU_ONLY), capture_output=True, text=True, timeout=180)
    assert job.returncode == 0, job.stdout + job.stderr
    lines = [(tmp_path / f"rank{r}.txt").read_text() for r in range(N)]
    assert [line.split(":")[0] for line in lines] == [f"rank {r}" for r in range(N)], job.stdout
    assert len({line.split(":")[1] for line in lines}) == 1, "every rank evaluates the same average"
