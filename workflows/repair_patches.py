"""The repair workflow's patches, and the one marker a new repair records for them all.

A patch (`workflow.patched`) keeps a history recorded before a change replaying as it ran. In a new run each patch
that is asked records a marker and, with it, an upsert of the TemporalChangeVersion search attribute (sdk-core does
both): two billed actions per patch per repair, 8 of a plain replacement's 72. A repair started by this code records
one marker, CURRENT, which stands for every patch in COVERED. A history recorded before CURRENT existed has no such
marker, so on its replay CURRENT reads False and each patch is asked as it was then; the SDK keeps a patch's first
answer for the rest of the run, so a run in flight at an upgrade goes on patch by patch, as it would have.

A new patch is asked on its own (not in COVERED) until the next CURRENT, a new id that covers it too; the CURRENT it
replaces goes to EARLIER, so the histories that recorded it replay as they ran.
"""

from __future__ import annotations

from temporalio import workflow

# Histories recorded before...
NEWS_BESIDE_STEPS = "news-beside-steps"  # a step's event and news to the health workflow went beside the next step
LAUNCH_OUTCOMES = "launch-outcomes"  # a repair told its semaphore how its launches went
VERIFY_REPLACEMENT = "verify-replacement"  # a replacement had to pass the gate before the impaired instance went
VERIFY_REPLACEMENT_ON_HOST = "verify-replacement-on-host"  # a replacement could be gated on the host
DRAIN_WAIT_IN_ACTIVITY = "drain-wait-in-activity"  # the tasks' stop was waited for in one activity
VERIFY_FIX = "verify-fix"  # a fix in place had to pass the gate before work returned
NEWS_TOGETHER = "news-together"  # a step's event and progress went in a batch, one activity for all made meanwhile

CURRENT = "repair-patches-2026-12-08"
COVERED = frozenset(
    {
        NEWS_BESIDE_STEPS,
        LAUNCH_OUTCOMES,
        VERIFY_REPLACEMENT,
        VERIFY_REPLACEMENT_ON_HOST,
        DRAIN_WAIT_IN_ACTIVITY,
        VERIFY_FIX,
        NEWS_TOGETHER,
    }
)
# Each earlier CURRENT and what it covered: a history that recorded it still reads every patch it stood for as True.
EARLIER = (("repair-patches-2026-12-07", COVERED - {NEWS_TOGETHER}),)


def patched(patch_id: str) -> bool:
    """`workflow.patched(patch_id)`, answered by CURRENT's one marker in a repair started by this code."""
    # In a new run CURRENT is asked first and records the run's one marker; an earlier marker is asked only on the
    # replay of a history without CURRENT's, where it reads as that history recorded it.
    for marker, covered in ((CURRENT, COVERED), *EARLIER):
        if patch_id in covered and workflow.patched(marker):
            return True
    return workflow.patched(patch_id)
