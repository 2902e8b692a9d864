"""EC2 instance id from the instance metadata service, IMDSv2 (session token first, as IMDSv1 may be off)."""

from __future__ import annotations

import urllib.error
import urllib.request

IMDS_ENDPOINT = "http://169.254.169.254"
TOKEN_TTL_SECONDS = 60


class ImdsError(RuntimeError):
    pass


def imds_instance_id(endpoint: str = IMDS_ENDPOINT, timeout: float = 1.0) -> str:
    """Blocking; off EC2 the link-local address does not answer, so the short timeout bounds the wait."""
    try:
        token_request = urllib.request.Request(
            f"{endpoint}/latest/api/token",
            method="PUT",
            headers={"X-aws-ec2-metadata-token-ttl-seconds": str(TOKEN_TTL_SECONDS)},
        )
        with urllib.request.urlopen(token_request, timeout=timeout) as response:
            token = response.read().decode().strip()
        id_request = urllib.request.Request(
            f"{endpoint}/latest/meta-data/instance-id", headers={"X-aws-ec2-metadata-token": token}
        )
        with urllib.request.urlopen(id_request, timeout=timeout) as response:
            instance_id = response.read().decode().strip()
    except (OSError, urllib.error.URLError) as exc:
        raise ImdsError(f"EC2 instance metadata (IMDSv2) at {endpoint} unavailable: {exc}") from exc
    if not instance_id:
        raise ImdsError(f"EC2 instance metadata (IMDSv2) at {endpoint} returned an empty instance id")
    return instance_id
