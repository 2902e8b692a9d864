"""The repair workflow's patches, and the one marker a new repair records for them all.

A patch (`workflow.patched`) keeps a history recorded before a change replaying as it ran. In a new run each patch
that is asked records a marker and, with it, an upsert of the TemporalChangeVersion search attribute (sdk-core does
both): two billed actions per patch per repair, 8 of a plain replacement's 72. A repair started by this code records
one marker, CURRENT, which stands for every patch in COVERED. A history recorded before CURRENT existed has no such
marker, so on its replay CURRENT reads False and each patch is asked as it was then; the SDK keeps a patch's first
answer for the rest of the run, so a run in flight at an upgrade goes on patch by patch, as it would have.

A new patch is asked on its own (not in COVERED) until the next CURRENT, a new id that covers it too.
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

CURRENT = "repair-patches-2026-12-07"
COVERED = frozenset(
    {
        NEWS_BESIDE_STEPS,
        LAUNCH_OUTCOMES,
        VERIFY_REPLACEMENT,
        VERIFY_REPLACEMENT_ON_HOST,
        DRAIN_WAIT_IN_ACTIVITY,
        VERIFY_FIX,
    }
)


def patched(patch_id: str) -> bool:
    """`workflow.patched(patch_id)`, answered by CURRENT's one marker in a repair started by this code."""
    if patch_id in COVERED and workflow.patched(CURRENT):
        return True
    return workflow.patched(patch_id)
