"""The main job's ``--delay-last-iteration``: parsed into PowerGossip(delayed_last_iteration=True), described in
the run's summary, and refused where it cannot apply (another algorithm, one power iteration, inside a composite)."""

from __future__ import annotations

import pytest

import gossip
from gossip.app.cli import build_parser, config_from
from gossip.app.run_dir import describe_mixing
from gossip.app.train import make_algorithm, resolve
from gossip.errors import ConfigError


def built(argv: list[str]):
    config, _ = resolve(config_from(build_parser().parse_args(argv)), 4)
    return config, make_algorithm(config)


def test_the_switch_delays_the_defaults_last_power_iteration():
    config, algorithm = built(["--delay-last-iteration"])
    assert type(algorithm) is gossip.PowerGossip and algorithm.delayed_last_iteration
    assert algorithm.num_iterations == 2 and algorithm.matrix_rank == 4
    assert "2 power iterations, the last applied a step later" in describe_mixing(config)
    _, default = built([])
    assert type(default) is gossip.PowerGossip and not default.delayed_last_iteration


def test_the_switch_keeps_the_default_pipeline_and_needs_no_note():
    config, notes = resolve(config_from(build_parser().parse_args(["--delay-last-iteration"])), 4)
    assert (config.outer_every, config.optimizer, config.gradient_tracking) == (0, "momentum-tracking-adamw", "sign")
    assert notes == []


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (["--algorithm", "exact"], "applies to --algorithm powergossip only, not exact"),
        (["--power-iterations", "1"], "add --power-iterations 2 or more"),
        (["--average-every", "8"], "PowerGossip inside --average-every cannot keep an exchange across steps"),
        (["--outer-every", "8"], "PowerGossip inside --outer-every cannot keep an exchange across steps"),
    ],
)
def test_the_switch_is_refused_where_it_cannot_apply(argv, reason):
    with pytest.raises(ConfigError, match=reason) as error:
        built(["--delay-last-iteration", *argv])
    assert error.value.option == "--delay-last-iteration"
