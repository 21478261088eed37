"""The documentation site builds, and the README leads to every page of it.

* ``mkdocs build --strict`` of ``mkdocs.yml`` succeeds: every page in the navigation exists, every page of docs/ is
  in the navigation, every link and anchor resolves, and the API pages render from the docstrings.
* ``mkdocs.yml`` makes each kind of link problem a warning (so strict mode fails on it), and a build with a broken
  link or anchor does fail with that configuration.
* README.md is the user's page: at most 150 lines, every relative link resolves (with its anchor, by the Git
  host's rule), and it links every page of the site's navigation and the experiments' and benchmarks' READMEs.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
CONFIG = REPO / "mkdocs.yml"
README = REPO / "README.md"
VALIDATION = ("omitted_files", "not_found", "absolute_links", "unrecognized_links", "anchors")


def config() -> dict[str, Any]:
    return yaml.safe_load(CONFIG.read_text(encoding="utf-8"))


def nav_pages(nav: list[Any]) -> list[str]:
    """Every page path of an mkdocs ``nav`` (nested sections flattened)."""
    found = []
    for entry in nav:
        value = next(iter(entry.values())) if isinstance(entry, dict) else entry
        found += nav_pages(value) if isinstance(value, list) else [value]
    return found


def build(config_file: Path, site: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(config_file), "--site-dir",
         str(site)],
        cwd=config_file.parent, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_the_site_builds_in_strict_mode(tmp_path):
    job = build(CONFIG, tmp_path / "site")
    assert job.returncode == 0, job.stdout + job.stderr
    assert "WARNING" not in job.stderr, job.stderr
    api = (tmp_path / "site" / "api" / "gossip" / "index.html").read_text(encoding="utf-8")
    assert 'id="gossip.DecentralizedDataParallel"' in api, "the API page is not generated from the docstrings"


def test_every_link_problem_is_a_warning_and_warnings_fail_the_build():
    settings = config()
    assert settings["strict"] is True
    assert {key: settings["validation"].get(key) for key in VALIDATION} == dict.fromkeys(VALIDATION, "warn")


@pytest.mark.parametrize(
    ("link", "complaint"),
    [
        ("other.md#nowhere", "does not contain an anchor '#nowhere'"),
        ("missing.md", "not found among documentation files"),
        ("../README.md", "not found among documentation files"),
        ("/other.md", "absolute link"),
    ],
)
def test_a_broken_link_fails_a_build_with_the_sites_validation(tmp_path, link, complaint):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "index.md").write_text(f"# Home\n\nSee [the other page]({link}).\n", encoding="utf-8")
    (docs / "other.md").write_text("# Other\n\n## Somewhere\n", encoding="utf-8")
    settings = {"site_name": "check", "docs_dir": "docs", "validation": config()["validation"]}
    settings["nav"] = ["index.md", "other.md"]
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(settings), encoding="utf-8")
    job = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert job.returncode != 0
    assert complaint in job.stderr, job.stderr


def readme_links() -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", README.read_text(encoding="utf-8"))


def test_the_readme_fits_on_a_few_screens():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 150


def github_anchors(markdown: str) -> set[str]:
    """The anchors a Git host gives the headings of ``markdown`` (GitHub's rule; fenced code is not a heading)."""
    anchors, fenced = set(), False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (heading := re.match(r"#{1,6} +(.*?) *#* *$", line)):
            anchors.add(re.sub(r"[^\w\- ]", "", heading.group(1).lower()).replace(" ", "-"))
    return anchors


def test_github_anchors_follow_the_hosts_rule():
    text = "# A: b (c) d\n```\n# not a heading\n```\n## The per-worker-Adam floor\n"
    assert github_anchors(text) == {"a-b-c-d", "the-per-worker-adam-floor"}


def test_every_relative_link_of_the_readme_resolves_with_its_anchor():
    relative = [link for link in readme_links() if not link.startswith(("http://", "https://"))]
    assert relative, "the README links its pages"
    assert [link for link in relative if not (REPO / link.split("#")[0]).exists()] == []
    anchored = [link.split("#") for link in relative if "#" in link]
    assert [
        f"{path}#{anchor}"
        for path, anchor in anchored
        if anchor not in github_anchors((REPO / path).read_text(encoding="utf-8"))
    ] == []


def test_the_readme_links_every_page_of_the_site_and_the_measurements():
    linked = {link.split("#")[0] for link in readme_links()}
    pages = [f"docs/{page}" for page in nav_pages(config()["nav"])]
    assert "docs/index.md" in pages
    pages.remove("docs/index.md")  # the site's home page is the README's own content
    pages.remove("docs/experiments.md")  # the site's pointer to the two READMEs, which the README links itself
    expected = {*pages, "experiments/README.md", "benchmarks/README.md"}
    assert expected - linked == set()
