"""The decent-dp comparison runner records the settings it runs (without decent-dp installed: only its config)."""

from __future__ import annotations

from experiments.time_to_loss.decentdp_runner import build_parser, train_config
from gossip.app.train import DEFAULTS


def test_the_recorded_optimizer_is_decent_dps_accum_adamw_whatever_gossip_trains_default():
    args = build_parser().parse_args(["--out", "unused"])
    config = train_config(args, world_size=8)
    assert DEFAULTS.optimizer != "accum-adamw"  # the case this pins: the main job's default is another optimizer
    assert config.optimizer == "accum-adamw"
    assert config.accum_iter == 2  # max(1, n // 4), as the runner passes to decent-dp's AccumAdamW
    assert config.lr == args.lr and config.steps == args.steps
