"""`moto_server`, with one fix: an EC2 resource's tags are read from moto's own per-resource index.

Moto 5.2's `TaggedEC2Resource.get_tags` asks `describe_tags` with a resource-id filter, which matches a regex against
every tag of every resource; DescribeInstances asks it for each instance it renders or filters by tag, so one call
costs instances x tags. At 1,000 simulated instances one DescribeInstances with a tag filter held moto's interpreter
for seconds and the engine's calls queued behind it past their timeouts (py-spy of the 1,000-instance demo). The
answer is the same list, in the same order: `describe_tags` walks the same dict.

    python -m simulator.moto_main -H 127.0.0.1 -p 5000     (moto_server's own flags)
"""

from __future__ import annotations

from moto.ec2.models.core import TaggedEC2Resource
from moto.ec2.utils import EC2_PREFIX_TO_RESOURCE, get_prefix
from moto.server import main


def _tags(self: TaggedEC2Resource) -> list[dict[str, str]]:
    resource_id = getattr(self, "id", None)
    if not resource_id:
        return []
    kind = EC2_PREFIX_TO_RESOURCE.get(get_prefix(resource_id), "")
    tags = self.ec2_backend.tags.get(resource_id, {})  # type: ignore[attr-defined]
    return [{"resource_id": resource_id, "key": k, "value": v, "resource_type": kind} for k, v in tags.items()]


if __name__ == "__main__":
    TaggedEC2Resource.get_tags = _tags  # type: ignore[method-assign]
    main()
