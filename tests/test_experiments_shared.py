"""The experiments' shared helpers (:mod:`experiments.shared`): CSV rows keep their columns, figures their budget."""

from __future__ import annotations

import pytest

from experiments.shared import append_rows, read_csv


def test_appended_rows_land_under_their_own_columns(tmp_path):
    path = tmp_path / "summary.csv"
    append_rows(path, [{"config": "a", "loss": 1.5}])
    append_rows(path, [{"config": "b", "loss": 1.25}, {"config": "c", "loss": 2.0}])
    assert read_csv(path) == [{"config": "a", "loss": 1.5}, {"config": "b", "loss": 1.25}, {"config": "c", "loss": 2.0}]


@pytest.mark.parametrize("keys", [("config", "warmup", "loss"), ("loss", "config"), ("config",)])
def test_appending_rows_with_other_columns_is_refused_and_the_file_is_left_as_it_was(tmp_path, keys):
    path = tmp_path / "summary.csv"
    append_rows(path, [{"config": "a", "loss": 1.5}])
    before = path.read_text()
    with pytest.raises(ValueError, match=r"summary\.csv: its columns \['config', 'loss'\] are not the rows'"):
        append_rows(path, [dict.fromkeys(keys, 1)])
    assert path.read_text() == before


def test_an_empty_file_takes_the_rows_header(tmp_path):
    path = tmp_path / "summary.csv"
    path.touch()
    append_rows(path, [{"config": "a", "loss": 1.5}])
    assert read_csv(path) == [{"config": "a", "loss": 1.5}]


def test_a_saved_figure_is_a_palette_png_within_its_byte_budget(tmp_path):
    from PIL import Image

    from experiments.shared import pyplot, save_figure

    figure, axis = pyplot().subplots(figsize=(6, 3))
    for k in range(8):
        axis.plot(range(50), [((i * (k + 3)) % 17) / 17 for i in range(50)], alpha=0.6)
    path = save_figure(figure, tmp_path / "plot.png")
    with Image.open(path) as image:
        assert (image.format, image.mode, image.size) == ("PNG", "P", (600, 300))
    with pytest.raises(ValueError, match="over the 1000-byte budget"):
        save_figure(pyplot().subplots()[0], tmp_path / "big.png", max_bytes=1000)
