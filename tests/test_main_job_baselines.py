"""experiments/main_job_baselines: the command each method runs and the summary's paired gaps."""

import argparse

import pytest

from experiments.main_job_baselines import study


def test_each_method_adds_its_options_to_the_same_command(tmp_path, monkeypatch):
    seen = []

    def fake_run(command, **kwargs):
        seen.append(command)
        out = tmp_path / command[command.index("--out") + 1]
        out.mkdir(parents=True)
        (out / "result.json").write_text('{"final_val_loss": 2.0, "final_train_loss": 1.5}')
        return argparse.Namespace(returncode=0)

    monkeypatch.setattr(study.subprocess, "run", fake_run)
    args = argparse.Namespace(nproc=8, batch_size=8, steps=1000, work=tmp_path.relative_to(tmp_path))
    monkeypatch.chdir(tmp_path)  # run directories relative to the work directory, as "--out" gets them
    rows = [study.run_once(method, 1, args) for method in ("defaults", "diloco")]
    shared = ["--nproc", "8", "--batch-size", "8", "--steps", "1000", "--seed", "1"]
    assert [command[3:][: len(shared)] for command in seen] == [shared, shared]
    assert seen[0][-2:] == ["--out", "defaults-s1"] and seen[1][-4:] == ["--out", "diloco-s1", "--algorithm", "diloco"]
    assert rows[0] == {"method": "defaults", "seed": 1, "final_train_loss": 1.5, "final_val_loss": 2.0,
                       "consensus_distance": "", "bytes_sent_per_worker_per_step": "", "train_seconds": ""}  # fmt: skip


def test_the_summary_pairs_each_method_with_the_defaults_by_seed():
    rows = [
        {"method": "defaults", "seed": 0, "final_val_loss": 1.0},
        {"method": "defaults", "seed": 1, "final_val_loss": 2.0},
        {"method": "ddp", "seed": 1, "final_val_loss": 1.5},
        {"method": "ddp", "seed": 0, "final_val_loss": 1.25},
    ]
    lines = study.summary_lines(rows)
    assert lines[0].startswith("defaults") and "1.500 ± 0.707" in lines[0] and "minus" not in lines[0]
    assert lines[1].startswith("ddp") and lines[1].endswith("minus the defaults, seeds +0.250 / -0.500")


def test_a_failed_run_is_an_error_with_its_stderr(tmp_path, monkeypatch):
    monkeypatch.setattr(study.subprocess, "run", lambda *a, **k: argparse.Namespace(returncode=1, stderr="boom"))
    args = argparse.Namespace(nproc=2, batch_size=4, steps=5, work=tmp_path)
    with pytest.raises(RuntimeError, match="ddp seed 0 failed \\(1\\):\nboom"):
        study.run_once("ddp", 0, args)


def algorithm_of(argv):
    from gossip.app.cli import build_parser, config_from
    from gossip.app.train import make_algorithm, resolve

    config = resolve(config_from(build_parser().parse_args(list(argv))), 8)[0]
    return config, make_algorithm(config)


def test_the_defaults_method_is_powergossip_alone_with_sign_momentum_tracking():
    import gossip

    config, defaults = algorithm_of(study.METHODS["defaults"])
    assert type(defaults) is gossip.PowerGossip and config.outer_every == 0
    assert (config.optimizer, config.gradient_tracking) == ("momentum-tracking-adamw", "sign")


def test_no_outer_step_is_the_hybrids_powergossip_and_adamw_alone():
    import gossip

    hybrid_config, hybrid = algorithm_of(study.METHODS["hybrid"])  # the main job's defaults of issues 27 to 59
    alone_config, alone = algorithm_of(study.METHODS["no-outer-step"])
    assert isinstance(hybrid, gossip.OuterOptimizer) and isinstance(hybrid.averaging, gossip.AllReduce)
    assert (hybrid.local_steps, hybrid.outer_lr, hybrid.outer_momentum) == (10, 1.0, 0.0)
    between = hybrid.between
    assert type(between) is gossip.PowerGossip and type(alone) is gossip.PowerGossip
    assert (between.matrix_rank, between.num_iterations, between.message_dtype) == (
        alone.matrix_rank,
        alone.num_iterations,
        alone.message_dtype,
    )
    for config in (hybrid_config, alone_config):
        assert (config.optimizer, config.gradient_tracking) == ("adamw", False)
