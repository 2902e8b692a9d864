"""One repair's timeline by phase as an SVG bar chart, drawn by hand (no plotting library in the dependencies).

Each phase with a duration is a bar that starts where the phase started and is as long as it lasted, on one time
scale, its seconds written beside it. The phases spent waiting on the world rather than on the engine (the
replacement booting, the tasks' stop timeouts, a reboot) are drawn apart and labelled as the physical floor: what no
engine could make shorter. The terminal phase (Completed, Failed) has no duration and no bar.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise
from xml.sax.saxutils import escape, quoteattr

from contract.repair import FINISHED, PhaseStep, RepairPhase

# The phases bounded by the world, and what bounds each.
PHYSICAL_FLOOR: dict[RepairPhase, str] = {
    RepairPhase.WAITING_FOR_REPLACEMENT: "physical floor: the replacement boots",
    RepairPhase.STOPPING_TASKS: "physical floor: the tasks' stop timeouts",
    RepairPhase.REBOOTING: "physical floor: the instance reboots",
}

WIDTH = 1100
LABEL_WIDTH = 200  # the phase names, left of the bars
BAR_AREA = 520  # the whole repair spans this many pixels
ROW = 30
BAR_HEIGHT = 18
TOP = 56  # title and axis above the first bar
BOTTOM = 40  # the legend below the last bar
ENGINE_COLOUR = "#4c78a8"
FLOOR_COLOUR = "#b0b0b0"


@dataclass(frozen=True)
class PhaseBar:
    phase: RepairPhase
    offset_s: float  # since the repair's first phase started
    seconds: float


def phase_bars(steps: Sequence[PhaseStep]) -> list[PhaseBar]:
    """The phases that have a duration: each until the next began. A last phase that is not an end state is
    still running and has no known length yet: it gets no bar either."""
    if not steps:
        return []
    start = steps[0].started_at
    return [
        PhaseBar(
            step.phase, (step.started_at - start).total_seconds(), (after.started_at - step.started_at).total_seconds()
        )
        for step, after in pairwise(steps)
        if step.phase not in FINISHED
    ]


def timeline_svg(steps: Sequence[PhaseStep], title: str) -> str:
    """The chart, as an SVG document. Every bar is a `rect` of class `bar` (`bar floor` for the physical floor)
    with its phase and seconds in `data-phase` and `data-seconds`, so a reader can check it without pixels."""
    bars = phase_bars(steps)
    total = max((bar.offset_s + bar.seconds for bar in bars), default=0.0)
    scale = BAR_AREA / total if total > 0 else 0.0
    height = TOP + ROW * len(bars) + BOTTOM
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="13">',
        f"<title>{escape(title)}</title>",
        f'<rect width="{WIDTH}" height="{height}" fill="white"/>',
        f'<text x="10" y="22" font-size="15" font-weight="bold">{escape(title)}</text>',
        f'<text x="{LABEL_WIDTH}" y="44" fill="#555">0 s</text>',
        f'<text x="{LABEL_WIDTH + BAR_AREA}" y="44" fill="#555" text-anchor="end">{total:.1f} s</text>',
    ]
    for row, bar in enumerate(bars):
        y = TOP + row * ROW
        floor = PHYSICAL_FLOOR.get(bar.phase)
        x, width = LABEL_WIDTH + bar.offset_s * scale, bar.seconds * scale
        text_y = y + BAR_HEIGHT - 4
        note = f"{bar.seconds:.1f} s" + (f" ({floor})" if floor else "")
        parts += [
            f'<text x="{LABEL_WIDTH - 8}" y="{text_y}" text-anchor="end">{escape(bar.phase.value)}</text>',
            f"<rect class={quoteattr('bar floor' if floor else 'bar')} data-phase={quoteattr(bar.phase.value)} "
            f'data-seconds="{bar.seconds:g}" x="{x:.2f}" y="{y}" width="{width:.4f}" height="{BAR_HEIGHT}" '
            f'fill="{FLOOR_COLOUR if floor else ENGINE_COLOUR}"/>',
            f'<text x="{x + width + 6:.2f}" y="{text_y}" fill="#333">{escape(note)}</text>',
        ]
    legend_y = TOP + ROW * len(bars) + 20
    parts += [
        f'<rect x="{LABEL_WIDTH}" y="{legend_y - 11}" width="12" height="12" fill="{ENGINE_COLOUR}"/>',
        f'<text x="{LABEL_WIDTH + 18}" y="{legend_y}">the engine\'s own steps</text>',
        f'<rect x="{LABEL_WIDTH + 200}" y="{legend_y - 11}" width="12" height="12" fill="{FLOOR_COLOUR}"/>',
        f'<text x="{LABEL_WIDTH + 218}" y="{legend_y}">physical floor: boot, stop timeouts, reboot</text>',
        "</svg>",
    ]
    return "\n".join(parts) + "\n"
