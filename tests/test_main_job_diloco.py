"""``--algorithm diloco`` in the main job: its options (``--local-steps``, ``--outer-lr``, ``--outer-momentum``)
parsed, resolved, turned into gossip.DiLoCo and refused where they change nothing; and a 2-process Gloo run that
sends bytes on its synchronisation steps only."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers.launch import completed_rows, main_job_run, metrics_rows

import gossip
from gossip.app.cli import build_parser, config_from, main
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.run_dir import describe_mixing
from gossip.app.train import DEFAULTS, DILOCO_DEFAULTS, ConfigError, TrainConfig, make_algorithm, resolve
from gossip.backends.base import ring_all_reduce_bytes

STEPS, LOCAL_STEPS = 8, 4


@pytest.fixture(scope="module")
def diloco_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    args = ["--nproc", "2", "--algorithm", "diloco", "--steps", str(STEPS), "--local-steps", str(LOCAL_STEPS)]
    args += ["--batch-size", "4", "--eval-every", str(LOCAL_STEPS)]
    return main_job_run(tmp_path_factory.mktemp("diloco"), args)


@pytest.mark.multiprocess
def test_a_short_diloco_run_exits_zero_and_learns(diloco_run):
    result, out = diloco_run
    losses = [float(row["mean_loss"]) for row in completed_rows(result, out, STEPS)]
    assert "diloco (4 local steps, outer Nesterov SGD lr 0.7 momentum 0.9)" in result.stdout
    assert losses[-1] < losses[0]


@pytest.mark.multiprocess
def test_bytes_are_sent_on_the_synchronisation_steps_only_an_all_reduce_of_the_parameters(diloco_run):
    """Steps 3 and 7 ((t + 1) % H == 0): a ring all-reduce of the float32 parameters; every other step nothing."""
    _, out = diloco_run
    model_bytes = 4 * GPT(GPTConfig()).num_parameters()
    sent = {int(row["step"]): int(row["bytes_sent"]) for row in metrics_rows(out)}
    synchronising = {LOCAL_STEPS - 1, 2 * LOCAL_STEPS - 1}
    assert sent == {step: ring_all_reduce_bytes(model_bytes, 2) if step in synchronising else 0 for step in sent}
    result = json.loads((out / "result.json").read_text())
    assert result["bytes_sent_per_worker_per_step"] == 2 * ring_all_reduce_bytes(model_bytes, 2) / STEPS
    for rank in range(2):  # every rank's own metrics agree
        rows = [json.loads(line) for line in (out / f"metrics_rank{rank}.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows if row["bytes_sent"]] == sorted(synchronising)


@pytest.mark.multiprocess
def test_config_json_records_the_diloco_settings(diloco_run):
    config = json.loads((diloco_run[1] / "config.json").read_text())
    assert config["algorithm"] == "diloco" and config["average_every"] == 0
    assert (config["local_steps"], config["outer_lr"], config["outer_momentum"]) == (LOCAL_STEPS, 0.7, 0.9)


def test_the_options_reach_the_algorithm():
    argv = ["--algorithm", "diloco", "--local-steps", "50", "--outer-lr", "0.5", "--outer-momentum", "0.8"]
    config, _ = resolve(config_from(build_parser().parse_args(argv)), 4)
    algorithm = make_algorithm(config)
    assert isinstance(algorithm, gossip.DiLoCo)
    assert algorithm.config() == {"local_steps": 50, "outer_lr": 0.5, "outer_momentum": 0.8, "nesterov": True}
    assert describe_mixing(config) == "diloco (50 local steps, outer Nesterov SGD lr 0.5 momentum 0.8)"


def test_unset_diloco_options_resolve_to_gossip_diloco_defaults_and_the_hybrid_keeps_its_own():
    config, _ = resolve(TrainConfig(algorithm="diloco"), 4)
    assert {option: getattr(config, option) for option in DILOCO_DEFAULTS} == DILOCO_DEFAULTS
    assert make_algorithm(config).config() == {**gossip.DiLoCo().config()}
    default, _ = resolve(TrainConfig(), 4)
    assert default.algorithm == DEFAULTS.algorithm != "diloco"
    # the defaults take no outer step, so no outer option applies to them
    assert (default.outer_every, default.outer_lr, default.outer_momentum, default.local_steps) == (0, None, None, None)
    hybrid, _ = resolve(TrainConfig(outer_every=10), 4)
    # a hybrid's outer step is a plain average, not DiLoCo's; local steps stay DiLoCo's alone
    assert (hybrid.outer_every, hybrid.outer_lr, hybrid.outer_momentum) == (10, 1.0, 0.0)
    assert (DEFAULTS.outer_lr, DEFAULTS.outer_momentum) != (
        DILOCO_DEFAULTS["outer_lr"],
        DILOCO_DEFAULTS["outer_momentum"],
    )
    assert hybrid.local_steps is None
    for algorithm in ("ddp", "allreduce"):
        other, _ = resolve(TrainConfig(algorithm=algorithm), 4)
        assert other.outer_every == 0
        assert all(getattr(other, option) is None for option in DILOCO_DEFAULTS)


@pytest.mark.parametrize(
    ("argv", "option", "says"),
    [
        (["--local-steps", "4"], "--local-steps", "applies to --algorithm diloco only, not powergossip"),
        (
            ["--algorithm", "exact", "--outer-every", "0", "--outer-lr", "0.5"],
            "--outer-lr",
            "applies to --algorithm diloco or --outer-every only, not exact",
        ),
        (["--algorithm", "ddp", "--outer-momentum", "0.5"], "--outer-momentum", "--outer-every only, not ddp"),
        (["--algorithm", "diloco", "--average-every", "4"], "--average-every", "synchronises every --local-steps"),
        (["--algorithm", "diloco", "--local-steps", "0"], "--local-steps", "must be positive"),
        (["--algorithm", "diloco", "--outer-lr", "-1"], "--outer-lr", "must be positive"),
        (["--algorithm", "diloco", "--outer-momentum", "1"], "--outer-momentum", "must be in [0, 1)"),
    ],
)
def test_a_diloco_option_out_of_range_or_without_diloco_is_an_argparse_error(capsys, argv, option, says):
    with pytest.raises(SystemExit) as exit_info:
        main(["--nproc", "2", *argv])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert f"argument {option}" in error and says in error, error


def test_a_config_out_of_range_is_refused_by_resolve_too():
    with pytest.raises(ConfigError, match=r"--outer-momentum: must be in \[0, 1\)"):
        resolve(TrainConfig(algorithm="diloco", outer_momentum=1.5), 2)
    with pytest.raises(ConfigError, match="--local-steps: must be an integer >= 1"):
        resolve(TrainConfig(algorithm="diloco", local_steps=0), 2)
