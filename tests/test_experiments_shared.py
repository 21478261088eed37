"""The experiments' CSV helpers (:mod:`experiments.shared`): rows appended keep their columns."""

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
