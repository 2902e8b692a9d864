"""The documentation's pictures and contents stay true: the timeline chart's bars are the repair's phases at their
lengths, the README's sample outputs are the captured files, and the operations guide's contents are its headings.

The pictures themselves are taken from a real run by `python -m docs.pictures.capture`; tests/test_web_ui.py takes
them from its own repair, so that path is tested end to end.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from contract.repair import PhaseStep, RepairPhase
from docs.pictures.capture import HISTORY_PAGE, README, SCREENSHOT, TIMELINE, paste_samples, sample_files
from docs.pictures.headless import png_size
from docs.pictures.timeline_svg import PHYSICAL_FLOOR, timeline_svg
from docs.toc import OPERATIONS, TocError, anchor, toc, with_toc

SVG = "{http://www.w3.org/2000/svg}"
T0 = datetime(2026, 12, 6, 19, 43, 12, tzinfo=UTC)
# A repair's phases with their lengths in seconds; the last, Completed, has none.
PHASES = [
    (RepairPhase.WAITING_FOR_PERMIT, 1.5),
    (RepairPhase.DRAINING, 0.3),
    (RepairPhase.LAUNCHING_REPLACEMENT, 0.5),
    (RepairPhase.WAITING_FOR_REPLACEMENT, 45.0),
    (RepairPhase.STOPPING_TASKS, 120.0),
    (RepairPhase.COLLECTING_EVIDENCE, 2.0),
    (RepairPhase.TERMINATING, 0.75),
]


def timeline() -> list[PhaseStep]:
    steps, at = [], T0
    for phase, seconds in PHASES:
        steps.append(PhaseStep(phase=phase, started_at=at))
        at += timedelta(seconds=seconds)
    return [*steps, PhaseStep(phase=RepairPhase.COMPLETED, started_at=at)]


def bars(svg: str) -> list[ET.Element]:
    return [e for e in ET.fromstring(svg).iter(f"{SVG}rect") if "bar" in (e.get("class") or "").split()]


def test_the_timeline_has_one_bar_per_phase_as_long_as_the_phase_lasted() -> None:
    drawn = bars(timeline_svg(timeline(), "repair of i-old"))
    assert [b.get("data-phase") for b in drawn] == [phase.value for phase, _ in PHASES]
    assert [float(b.get("data-seconds") or "nan") for b in drawn] == [seconds for _, seconds in PHASES]
    # One scale for every bar: pixels per second the same for each, and each bar starts where the one before ended.
    widths = [float(b.get("width") or "nan") for b in drawn]
    per_second = [width / seconds for width, (_, seconds) in zip(widths, PHASES, strict=True)]
    assert max(per_second) == pytest.approx(min(per_second), rel=1e-3)
    xs = [float(b.get("x") or "nan") for b in drawn]
    for x, width, following in zip(xs, widths, xs[1:], strict=False):
        assert x + width == pytest.approx(following, abs=0.02)


def test_the_boot_and_the_stop_timeouts_are_labelled_as_the_physical_floor() -> None:
    svg = timeline_svg(timeline(), "repair of i-old")
    floor = {b.get("data-phase") for b in bars(svg) if "floor" in (b.get("class") or "").split()}
    assert floor == {RepairPhase.WAITING_FOR_REPLACEMENT.value, RepairPhase.STOPPING_TASKS.value}
    texts = [t.text for t in ET.fromstring(svg).iter(f"{SVG}text")]
    assert f"45.0 s ({PHYSICAL_FLOOR[RepairPhase.WAITING_FOR_REPLACEMENT]})" in texts
    assert f"120.0 s ({PHYSICAL_FLOOR[RepairPhase.STOPPING_TASKS]})" in texts
    assert "0.3 s" in texts  # Draining: the engine's own step, no floor label


def test_a_repair_still_running_draws_only_the_phases_that_ended() -> None:
    running = timeline()[:5]  # its last phase, StoppingTasks, has no end yet
    assert [b.get("data-phase") for b in bars(timeline_svg(running, "r"))] == [p.value for p, _ in PHASES[:4]]
    assert bars(timeline_svg([], "nothing yet")) == []


def test_the_checked_in_pictures_are_there_and_the_readme_shows_them() -> None:
    pictures = README.parent / "docs" / "pictures"
    for name in (SCREENSHOT, HISTORY_PAGE):
        width, height = png_size((pictures / name).read_bytes())
        assert width >= 1000 and height >= 600, name
    assert bars((pictures / TIMELINE).read_text(encoding="utf-8"))
    readme = README.read_text(encoding="utf-8")
    assert f"docs/pictures/{SCREENSHOT}" in readme and f"docs/pictures/{TIMELINE}" in readme


def test_the_readme_samples_are_the_captured_outputs() -> None:
    readme = README.read_text(encoding="utf-8")
    assert sample_files(readme) == ["docs/pictures/describe-instances.txt", "docs/pictures/history.txt"]
    # `python -m docs.pictures.capture` pastes them; a README edited by hand (or a capture not pasted) fails here.
    assert paste_samples(readme) == readme


def test_pasting_replaces_only_the_marked_blocks(tmp_path: Path) -> None:
    (tmp_path / "docs" / "pictures").mkdir(parents=True)
    (tmp_path / "docs" / "pictures" / "a.txt").write_text("$ autorepair history\nnew\n")
    text = "intro\n<!-- sample: docs/pictures/a.txt -->\n```text\nold\n```\n\n```text\nnot marked\n```\n"
    assert paste_samples(text, tmp_path) == text.replace("old\n", "$ autorepair history\nnew\n")


def test_the_operations_guide_contents_are_its_headings() -> None:
    guide = OPERATIONS.read_text(encoding="utf-8")
    # Stale after a section is added or renamed: `python -m docs.toc` writes it again.
    assert with_toc(guide) == guide, "docs/operations.md's contents are stale: run `python -m docs.toc`"


def test_contents_skip_code_and_tell_repeated_headings_apart() -> None:
    text = (
        "# Title\n<!-- toc -->\n## 1. First: `a_b`, c\n```\n# a shell comment\n## not a heading\n```\n"
        "### Detail\n## 2. Second\n### Detail\n#### Deeper\n"
    )
    assert toc(text) == (
        "- [1. First: `a_b`, c](#1-first-a_b-c)\n"
        "  - [Detail](#detail)\n"
        "- [2. Second](#2-second)\n"
        "  - [Detail](#detail-1)"
    )
    assert anchor("The ingest's metrics") == "the-ingests-metrics"
    with pytest.raises(TocError):
        with_toc(text)
