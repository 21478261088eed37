"""``--gradient-tracking powergossip`` and ``sign`` in the main job: parsed next to the bare flag and
``--no-gradient-tracking``, turned into a PowerGossip at ``--rank`` or a gossip.ChocoSign for the trackers (the
defaults' are sign ones), refused where unknown; and 2-process Gloo runs with AdamW whose every step sends the
parameters' gossip plus the trackers' compressed messages (with the overlapped tracker, ``--tracking-overlap``, which
needs trackers), and the optimizers' comparison with the peers at the first steps."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from helpers.launch import completed_rows, main_job_run
from helpers.tracking_scenarios import comparison_bytes

import gossip
from gossip.app.cli import build_parser, config_from, main
from gossip.app.gpt import GPT, GPTConfig
from gossip.app.train import ConfigError, TrainConfig, resolve, tracking_option

STEPS = 4


@pytest.mark.parametrize(
    ("argv", "value"),
    [
        ([], None),  # unset: resolve decides (test_main_job_gradient_tracking)
        (["--gradient-tracking"], True),
        (["--gradient-tracking", "exact"], "exact"),
        (["--gradient-tracking", "powergossip"], "powergossip"),
        (["--gradient-tracking", "sign"], "sign"),
        (["--gradient-tracking", "--no-gradient-tracking"], False),
    ],
)
def test_the_option_parses_to_unset_off_exact_powergossip_or_sign(argv, value):
    assert config_from(build_parser().parse_args(argv)).gradient_tracking == value


def test_powergossip_trackers_are_a_powergossip_at_the_main_jobs_rank_and_sign_ones_a_choco_sign():
    config, _ = resolve(TrainConfig(algorithm="exact", gradient_tracking="powergossip", rank=2), 4)
    option = tracking_option(config)
    assert isinstance(option, gossip.PowerGossip) and option.matrix_rank == 2
    signs = tracking_option(resolve(TrainConfig(algorithm="exact", gradient_tracking="sign"), 4)[0])
    assert isinstance(signs, gossip.ChocoSign) and signs.config() == gossip.ChocoSign().config()
    assert tracking_option(resolve(TrainConfig(gradient_tracking="exact"), 4)[0]) is True
    assert tracking_option(resolve(TrainConfig(outer_every=10), 4)[0]) is False  # a hybrid tracks nothing


def test_the_defaults_trackers_are_a_choco_sign():
    default = tracking_option(resolve(TrainConfig(), 4)[0])
    assert isinstance(default, gossip.ChocoSign) and default.config() == gossip.ChocoSign().config()


def test_an_unknown_mixing_is_refused_by_argparse_and_by_resolve(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--nproc", "2", "--gradient-tracking", "sparse"])
    assert exit_info.value.code == 2 and "argument --gradient-tracking: invalid choice" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="--gradient-tracking: must be off, on, 'exact', 'powergossip' or 'sign'"):
        resolve(TrainConfig(gradient_tracking="sparse"), 2)


@pytest.fixture(scope="module")
def compressed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess, Path]:
    args = ["--nproc", "2", "--steps", str(STEPS), "--algorithm", "exact", "--gradient-tracking", "powergossip"]
    args += ["--optimizer", "adamw", "--tracking-overlap", "--batch-size", "4", "--eval-every", str(STEPS)]
    return main_job_run(tmp_path_factory.mktemp("tracking"), args)


@pytest.mark.multiprocess
def test_a_compressed_tracking_run_sends_the_model_and_the_trackers_products_every_step(compressed_run):
    rows = completed_rows(*compressed_run, STEPS)
    # one peer per step: exact gossip sends the float32 model; the trackers' PowerGossip (rank 4) adds its
    # compressed products and uncompressed small tensors, a few percent of the model, not a second model; beside
    # them the optimizers' comparison
    model_bytes = 4 * GPT(GPTConfig()).num_parameters()
    compared = comparison_bytes("one_peer_hypercube", 2, 0, STEPS)
    sent = [int(row["bytes_sent"]) - c for row, c in zip(rows, compared, strict=True)]
    assert all(model_bytes < b < 1.1 * model_bytes for b in sent), rows


def test_tracking_overlap_reaches_the_wrapper_and_needs_tracking(capsys):
    config = config_from(build_parser().parse_args(["--gradient-tracking", "--tracking-overlap"]))
    assert config.tracking_overlap is True and config_from(build_parser().parse_args([])).tracking_overlap is False
    with pytest.raises(SystemExit) as exit_info:
        main(["--nproc", "2", "--no-gradient-tracking", "--tracking-overlap"])
    assert exit_info.value.code == 2
    assert "argument --tracking-overlap: overlaps the trackers' exchange: add --gradient-tracking" in (
        capsys.readouterr().err
    )


def test_tracking_overlap_alone_overlaps_the_defaults_sign_trackers():
    config, _ = resolve(config_from(build_parser().parse_args(["--tracking-overlap"])), 4)
    assert (config.gradient_tracking, config.tracking_overlap) == ("sign", True)


@pytest.mark.multiprocess
def test_a_sign_tracking_run_sends_powergossip_and_a_sign_message_of_the_trackers(tmp_path):
    """``--gradient-tracking sign --tracker-hops 1`` with PowerGossip for the parameters, 2 Gloo processes: every
    step sends the parameters' products and the trackers' message of 3 bits a value and four float32 scales per 256
    values (3/32 + 1/64 of the float32 model); together between 3/32 and 1/6 of the model, beside the optimizers'
    comparison."""
    args = ["--nproc", "2", "--steps", str(STEPS), "--algorithm", "powergossip", "--optimizer", "adamw"]
    args += ["--gradient-tracking", "sign", "--tracker-hops", "1", "--batch-size", "4", "--eval-every", str(STEPS)]
    rows = completed_rows(*main_job_run(tmp_path, args), STEPS)
    model_bytes = 4 * GPT(GPTConfig()).num_parameters()
    compared = comparison_bytes("one_peer_hypercube", 2, 0, STEPS)
    sent = [int(row["bytes_sent"]) - c for row, c in zip(rows, compared, strict=True)]
    assert all(model_bytes * 3 / 32 < b < model_bytes / 6 for b in sent), rows
