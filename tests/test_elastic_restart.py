"""``gossip-train --elastic --restart RANK@STEP``: a killed worker is started again and joins at STEP or later.

Pinned with real Gloo processes of the main job (4 workers, a few steps):

* the job exits 0; result.json's membership lists the departure (who, how) and then the join (the joiner, its
  donor, the bytes handed over: at least the parameters and AdamW's two moments), over the right member sets;
  two workers killed at the same step die together: one change names both;
* the joiner's first step is at or after the restart step, and it says so in one line;
* the replicas saved at the evaluations hold exactly the members of that moment (all 4 before the kills, the 2
  survivors at the restart step, those and the joiner at the end);
* a restarted worker whose group died before reaching its step ends the job with status 1, named, never a hang;
* the option's misuse is an argparse error naming ``--restart`` (a ``ConfigError`` underneath): without
  ``--elastic``, without a ``--kill`` of that worker, at or before its kill, at or after the last step, twice.
"""

from __future__ import annotations

import json
import re

import pytest
from helpers.launch import run_main_job

from gossip.app.cli import main
from gossip.app.elastic_launch import check_restarts
from gossip.app.gpt import GPT, GPTConfig
from gossip.errors import ConfigError

TINY = ["--nproc", "4", "--elastic", "--batch-size", "4", "--algorithm", "exact"]


@pytest.mark.multiprocess
def test_restarted_worker_joins_at_or_after_its_step_from_a_donor(tmp_path):
    out = tmp_path / "run"
    args = [*TINY, "--kill", "1@8", "--kill", "2@8", "--restart", "2@16", "--steps", "40", "--eval-every", "8",
            "--save-replicas", "--out", str(out)]  # fmt: skip
    result = run_main_job(args, tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    left, joined = json.loads((out / "result.json").read_text())["membership"]
    assert left["left"] == {"1": "killed by SIGKILL", "2": "killed by SIGKILL"}  # one change for both
    assert left["members"] == [0, 3] and left["joined"] == {}
    assert joined["left"] == {} and joined["members"] == [0, 3, 2]  # a joiner comes last
    donor = joined["joined"]["2"]
    assert donor in (0, 3)
    parameters = GPT(GPTConfig()).num_parameters()
    assert joined["handover_bytes"] >= 3 * 4 * parameters  # float32 parameters and AdamW's two moments
    assert joined["resume_step"] >= 16
    said = re.findall(r"member 2 joined at step (\d+) \(donor: (\d+)\)", result.stdout)
    assert said == [(str(joined["resume_step"]), str(donor))]
    assert "restarting worker 2; it joins at step 16" in result.stderr
    saved = {}
    for path in (out / "replicas").glob("*.pt"):
        step, uid = map(int, path.stem.split("_"))
        saved.setdefault(step, set()).add(uid)
    assert saved == {8: {0, 1, 2, 3}, 16: {0, 3}, 24: saved[24], 32: saved[32], 40: {0, 2, 3}}
    assert {0, 3} <= saved[24] <= {0, 2, 3} and {0, 3} <= saved[32] <= {0, 2, 3}  # 2 in them once it joined


@pytest.mark.multiprocess
def test_restart_whose_group_died_first_fails_the_job_named(tmp_path):
    # workers 0 and 2 die together after the departure of 1: nobody is left to reach step 20
    args = ["--nproc", "3", "--elastic", "--batch-size", "4", "--algorithm", "exact", "--kill", "1@4", "--kill",
            "0@14", "--kill", "2@14", "--restart", "1@20", "--steps", "30", "--eval-every", "100", "--out",
            str(tmp_path / "run")]  # fmt: skip
    result = run_main_job(args, tmp_path, timeout=150)
    assert result.returncode == 1
    output = result.stdout + result.stderr
    restarted = "restarting worker 1; it joins at step 20" in result.stderr
    if restarted:  # the usual order: restarted once 1's departure was agreed, then cancelled
        assert "MembershipError: member 1: restarted to join at step 20, but every other worker ended" in output
        assert "worker 1 of 3 exited with status 1" in result.stderr
    else:  # 0 and 2 died before the launcher saw the departure agreed
        assert "worker 1 not restarted: every other worker ended before its departure was agreed" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nproc", "4", "--kill", "2@8", "--restart", "2@16"], "argument --kill: needs --elastic"),
        (["--nproc", "4", "--restart", "2@16"], "argument --restart: needs --elastic"),
        (["--nproc", "4", "--elastic", "--restart", "2@16"], "worker 2 is restarted at step 16 but never killed"),
        (["--nproc", "4", "--elastic", "--kill", "2@8", "--restart", "2@8"], "not after its --kill at step 8"),
        (["--nproc", "4", "--elastic", "--kill", "2@8", "--restart", "2@40", "--steps", "40"],
         "not before the last step (--steps 40)"),
        (["--nproc", "4", "--elastic", "--kill", "2@8", "--restart", "2@16", "--restart", "2@20"],
         "a worker is restarted at most once"),
        (["--nproc", "4", "--elastic", "--kill", "4@8"], "argument --kill: worker 4@8 does not exist"),
        (["--nproc", "4", "--save-replicas"], "argument --save-replicas: needs --elastic"),
    ],
)  # fmt: skip
def test_restart_misuse_is_an_argparse_error_naming_the_option(args, message, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(args)
    assert stopped.value.code == 2
    assert message in capsys.readouterr().err


def test_check_restarts_raises_a_config_error_naming_restart():
    with pytest.raises(ConfigError, match="never killed") as raised:
        check_restarts({}, {1: 5}, 4, 10)
    assert raised.value.option == "--restart"
    check_restarts({1: 4}, {1: 5}, None, 10)  # a restart after its kill, before the end: accepted
