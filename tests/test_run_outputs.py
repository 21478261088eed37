"""Standard outputs of a run directory: TensorBoard scalars beside the JSON lines, plots titled with the run's
configuration whose validation curve starts before training, and library messages through ``logging``."""

from __future__ import annotations

import ast
import json
import logging
from pathlib import Path

import matplotlib.figure
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

import gossip
import topologies
from gossip.app.run_dir import PLOTS, fit_titles, plot_title, validation_curve, write_plots
from gossip.app.train import TrainConfig, resolve, train
from gossip.wrapper import metrics

REPO = Path(__file__).resolve().parent.parent
N = 2
STEPS = 4


def train_with_run_dir(run_dir: Path) -> None:
    def run(comm: gossip.Communicator) -> None:
        torch.manual_seed(0)
        model = gossip.DecentralizedDataParallel(
            nn.Linear(4, 2), comm, topologies.ring(comm.size), gossip.ExactGossip(), run_dir=run_dir
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        generator = torch.Generator().manual_seed(comm.rank)
        for _ in range(STEPS):
            x = torch.randn(3, 4, generator=generator)
            loss = nn.functional.mse_loss(model(x), x[:, :2])
            loss.backward()
            model.log(loss=loss)
            optimizer.step()
            optimizer.zero_grad()
        model.close()

    gossip.simulate(N, run)


def test_tensorboard_scalars_hold_the_json_lines_values_for_every_rank(tmp_path):
    train_with_run_dir(tmp_path)
    for rank in range(N):
        rows = [json.loads(line) for line in (tmp_path / f"metrics_rank{rank}.jsonl").read_text().splitlines()]
        events = EventAccumulator(str(tmp_path / "tensorboard" / f"rank{rank}"))
        events.Reload()
        for name in ("loss", "bytes_sent", "step_seconds"):
            logged = [(event.step, event.value) for event in events.Scalars(name)]
            expected = [(row["step"], torch.tensor(row[name], dtype=torch.float32).item()) for row in rows]
            assert logged == expected, (rank, name)


def test_without_the_tensorboard_package_only_the_json_lines_are_written(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "tensorboard_available", lambda: False)
    train_with_run_dir(tmp_path)
    assert not (tmp_path / "tensorboard").exists()
    assert (tmp_path / "metrics_rank1.jsonl").read_text().count("\n") == STEPS


def test_plot_title_names_the_defaults_trackers_and_how_the_mean_gradient_is_sampled():
    config, _ = resolve(TrainConfig(steps=300, seed=7), world_size=4)
    assert plot_title(config) == (
        "powergossip on one_peer_hypercube (rank 4, 2 power iterations, float16 messages), sign trackers of the first "
        "moments, the mean gradient's second moment every 64 steps by gossip, 4 workers, momentum-tracking-adamw "
        "lr 0.003, 300 steps x 16, iid, seed 7"
    )


def test_plot_title_names_the_configuration():
    config, _ = resolve(
        TrainConfig(
            algorithm="powergossip",
            rank=2,
            power_iterations=3,
            outer_every=10,
            optimizer="accum-adamw",
            steps=300,
            seed=7,
        ),
        world_size=4,
    )
    assert plot_title(config) == (
        "powergossip on one_peer_hypercube (rank 2, 3 power iterations, float16 messages), exact average every 10 "
        "steps (outer step, lr 1, no momentum), 4 workers, accum-adamw "
        "lr 0.003, "
        "300 steps x 16, iid, seed 7"
    )


def test_validation_curve_starts_with_the_model_before_training():
    rows = [{"step": s, "elapsed_seconds": 0.5 * (s + 1)} for s in range(4)]
    rows[1]["val_loss"], rows[3]["val_loss"] = 2.0, 1.5
    assert validation_curve(rows, "step", 3.0) == ([0.0, 2, 4], [3.0, 2.0, 1.5])
    assert validation_curve(rows, "elapsed_seconds", 3.0) == ([0.0, 1.0, 2.0], [3.0, 2.0, 1.5])


def test_every_plot_carries_the_title_and_the_first_validation_point(tmp_path, monkeypatch):
    saved = {}

    def record(figure: matplotlib.figure.Figure, path: Path, **kwargs: object) -> None:
        axis = figure.axes[0]
        saved[Path(path).name] = (axis.get_title(), [line.get_xydata().tolist() for line in axis.get_lines()])

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    rows = [
        {"step": s, "mean_loss": 3.0 - s, "elapsed_seconds": s + 1.0, "cumulative_bytes_sent": 1e6 * (s + 1)}
        for s in range(3)
    ]
    rows[2]["val_loss"] = 1.25
    rows[0]["consensus"] = 0.5
    write_plots(tmp_path, rows, "the title", initial_val_loss=4.0)
    assert sorted(saved) == sorted(PLOTS)
    assert all(title == "the title" for title, _ in saved.values())
    for name in ("loss_vs_step.png", "loss_vs_time.png", "loss_vs_bytes.png"):
        validation = saved[name][1][1]
        assert validation[0] == [0.0, 4.0] and validation[-1][1] == 1.25, name


LONG_CONFIG = TrainConfig(
    algorithm="powergossip", rank=4, power_iterations=2, average_every=16, optimizer="accum-adamw", steps=10000
)


def title_inside(figure: matplotlib.figure.Figure) -> bool:
    """Whether every axes title's rendered extent lies inside the figure."""
    figure.canvas.draw()
    bounds = figure.bbox
    extents = [axis.title.get_window_extent() for axis in figure.axes if axis.get_title()]
    return bool(extents) and all(
        bounds.x0 <= e.x0 and e.x1 <= bounds.x1 and bounds.y0 <= e.y0 and e.y1 <= bounds.y1 for e in extents
    )


def test_every_plot_title_fits_inside_its_figure(tmp_path, monkeypatch):
    config, _ = resolve(LONG_CONFIG, world_size=16)
    title = plot_title(config)
    fits = {}

    def record(figure: matplotlib.figure.Figure, path: Path, **kwargs: object) -> None:
        fits[Path(path).name] = (title_inside(figure), figure.axes[0].get_title().split())

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", record)
    rows = [{"step": s, "mean_loss": 3.0, "elapsed_seconds": s + 1.0, "cumulative_bytes_sent": 1e6} for s in range(3)]
    rows[0]["consensus"] = 0.5
    write_plots(tmp_path, rows, title, initial_val_loss=4.0)
    assert sorted(fits) == sorted(PLOTS)
    for name, (inside, words) in fits.items():
        assert inside, f"{name}: the title runs past the figure"
        assert words == title.split(), f"{name}: wrapping changed the title's words"


@pytest.mark.parametrize("fontsize", [8, 12, 16])
def test_fit_titles_wraps_only_a_title_that_overflows(fontsize):
    import matplotlib.pyplot as plt

    config, _ = resolve(LONG_CONFIG, world_size=16)
    figure, (left, right) = plt.subplots(1, 2, figsize=(7, 4.5))
    left.set_title(plot_title(config), fontsize=fontsize)
    right.set_title("short", fontsize=fontsize)
    assert not title_inside(figure)
    fit_titles(figure)
    assert title_inside(figure)
    assert "\n" in left.get_title() and right.get_title() == "short"
    plt.close(figure)


def test_experiment_figures_fit_their_titles(tmp_path):
    from experiments.shared import pyplot, save_figure

    config, _ = resolve(LONG_CONFIG, world_size=16)
    figure, axis = pyplot().subplots(figsize=(7, 4.5))
    axis.plot([0, 1], [1, 0])
    axis.set_title(plot_title(config), fontsize=10)
    save_figure(figure, tmp_path / "plot.png")
    assert title_inside(figure)


def _prints(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call)]
    return [node.lineno for node in calls if isinstance(node.func, ast.Name) and node.func.id == "print"]


@pytest.mark.parametrize("package", ["gossip", "optim", "topologies"])
def test_library_modules_log_instead_of_printing(package):
    """Only the command-line entry points (``__main__``, the main job's ``gossip/app/cli.py``) write to stdout
    themselves."""
    found = {
        str(path.relative_to(REPO)): lines
        for path in sorted((REPO / package).rglob("*.py"))
        if path.name != "__main__.py" and path != REPO / "gossip" / "app" / "cli.py" and (lines := _prints(path))
    }
    assert found == {}


def test_the_main_jobs_notes_go_through_the_gossip_logger(caplog, monkeypatch, tmp_path, capsys):
    for name in ("RANK", "WORLD_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    caplog.set_level(logging.INFO, logger="gossip")
    config = TrainConfig(steps=2, batch_size=2, eval_batches=1, backend="gloo", out=str(tmp_path / "run"))
    train(config)
    banner = [
        r for r in caplog.records if r.name == "gossip.app.train" and "gossip-train: 1 worker(s)" in r.getMessage()
    ]
    assert len(banner) == 1
    assert "gossip-train:" not in capsys.readouterr().out  # logged, not printed
