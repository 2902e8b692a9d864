"""Where a repair keeps the evidence of its fault in S3, and what it keeps: named once, for the repair, the
simulated fleet, the docs and an operator's `aws s3 ls`.

An incident's objects sit under `<evidence_prefix><group>/<instance>/<attempt>/` of the group's `evidence_bucket`:
- `findings.json`: the finding the repair is for, the probe's recent findings and sources, as the health workflow
  holds them (written by the worker);
- `kernel-log.txt`: the kernel-log lines of those findings, oldest first, and the lines around each impairing
  fault as the probe sent them (written by the worker);
- `host/kernel-log.txt` and `host/nvidia-bug-report.log.gz`: where the group has `bug_report`, read on the host by an
  SSM Run Command and uploaded through presigned URLs, one per object, that expire: the host never holds a
  credential that could write anything else;
- `manifest.json`: last, what is there and what is missing, and why.
"""

from __future__ import annotations

from typing import Final

FINDINGS: Final = "findings.json"
KERNEL_LINES: Final = "kernel-log.txt"
HOST_KERNEL_LOG: Final = "host/kernel-log.txt"
HOST_BUG_REPORT: Final = "host/nvidia-bug-report.log.gz"
MANIFEST: Final = "manifest.json"
HOST_OBJECTS: Final = (HOST_KERNEL_LOG, HOST_BUG_REPORT)
# The comment of the SSM Run Command that collects the host's part: this, the instance id, the step's token.
EVIDENCE_COMMENT: Final = "gpu-autorepair evidence"
# The EC2 tag a quarantined instance carries: the repair that stopped it instead of terminating it.
QUARANTINE_TAG: Final = "gpu-autorepair:quarantined"


def incident_prefix(prefix: str, group: str, instance_id: str, attempt: int) -> str:
    """The key prefix of one repair attempt's evidence (attempt 0: a repair from before attempt ids)."""
    return f"{prefix}{group}/{instance_id}/attempt-{attempt}/"


def s3_url(bucket: str, key: str) -> str:
    return f"s3://{bucket}/{key}"
