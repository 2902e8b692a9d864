"""`moto_server`, with three fixes, and three lookups of its own made once.

An EC2 resource's tags are read from moto's own per-resource index.

Moto 5.2's `TaggedEC2Resource.get_tags` asks `describe_tags` with a resource-id filter, which matches a regex against
every tag of every resource; DescribeInstances asks it for each instance it renders or filters by tag, so one call
costs instances x tags. At 1,000 simulated instances one DescribeInstances with a tag filter held moto's interpreter
for seconds and the engine's calls queued behind it past their timeouts (py-spy of the 1,000-instance demo). The
answer is the same list, in the same order: `describe_tags` walks the same dict.

DeregisterContainerInstance of a container instance that is not (or no longer) in the cluster answers a
ClientException, "Container instance not found", as ECS does, not a bare Exception (HTTP 500). ECS lets go of a
terminated instance by itself, and so does the simulated fleet: a repair that terminated the instance and then
deregistered it met the 500, botocore's five retries, and a failed activity attempt, in every repair of every demo.

An SSM command sent to InstanceIds, without Targets, is for those instances alone, as in SSM. Moto 5.2 also adds the
instances its targets' EC2 filter matches, and with no targets that filter is empty and matches every instance: at
1,000 simulated instances each command of a repair (evidence, GPU reset) held a thousand instance ids and
invocations, and ListCommands of one instance answered every command ever sent, megabytes each; the simulated hosts'
SSM agents spent a fifth of the simulator's CPU parsing them (py-spy of a 1,000 / 200 run). A command without
targets now keeps the instances it names.

Two lookups moto makes on every request are made once: the list of its service packages (a directory walk: an
`isdir` per service, about 12 % of moto's CPU in `make test` by py-spy) and the action methods of a response class
(`inspect.getmembers`, about 4 %). Neither changes while the server runs. The request log (werkzeug's, a line per
call) is off: the tests and the demo send it to /dev/null, after formatting it.

The third: where its response serializer looks for each field of an answer on moto's object. For every field of
every object it answers with, moto asks six alias rules for the attribute names that field may have, from the field's
shape and the object's class alone, and the answer is the same each time: a quarter of the time moto took to answer
DescribeInstances of 200 instances (0.52 s; 0.41-0.44 s with the names worked out once per picker, class, field and
shape), which the simulated fleet's counts, the engine's lookups and the drain semaphore's count of a group all ask.

    python -m simulator.moto_main -H 127.0.0.1 -p 5000     (moto_server's own flags)
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import moto.backends
import moto.core.responses
from moto.core.serialize import AttributePicker, AttributePickerContext, XFormedAttributePicker
from moto.ec2.models.core import TaggedEC2Resource
from moto.ec2.utils import EC2_PREFIX_TO_RESOURCE, get_prefix
from moto.ecs.exceptions import EcsClientException
from moto.ecs.models import EC2ContainerServiceBackend
from moto.server import main
from moto.ssm.models import Command


def _tags(self: TaggedEC2Resource) -> list[dict[str, str]]:
    resource_id = getattr(self, "id", None)
    if not resource_id:
        return []
    kind = EC2_PREFIX_TO_RESOURCE.get(get_prefix(resource_id), "")
    tags = self.ec2_backend.tags.get(resource_id, {})  # type: ignore[attr-defined]
    return [{"resource_id": resource_id, "key": k, "value": v, "resource_type": kind} for k, v in tags.items()]


_deregister = EC2ContainerServiceBackend.deregister_container_instance


def _deregister_known(
    self: EC2ContainerServiceBackend, cluster_str: str, container_instance_str: str, force: bool
) -> Any:
    cluster = self._get_cluster(cluster_str)
    if container_instance_str.split("/")[-1] not in self.container_instances.get(cluster.name, {}):
        raise EcsClientException("Container instance not found.")
    return _deregister(self, cluster_str, container_instance_str, force)


_command_init = Command.__init__


def _command_for_named(self: Command, *args: Any, **kwargs: Any) -> None:
    # moto still matches its empty filter against every instance once per command (inside __init__); the command
    # then keeps its named instances alone, and an invocation for each of them only.
    named = list(kwargs.get("instance_ids") or [])
    _command_init(self, *args, **{**kwargs, "instance_ids": list(named)})  # moto extends the list it is given
    if not self.targets:
        self.instance_ids = named
        self.completed_count = self.target_count = len(named)
        self.invocations = [self.invocation_response(instance_id, "aws:runShellScript") for instance_id in named]


PossibleKeys = Callable[[Any, AttributePickerContext], Iterable[str]]
_KEYS_MAX = 100_000


def _once(possible_keys: PossibleKeys) -> PossibleKeys:
    # Keyed by the shape objects themselves (botocore keeps one per field of its loaded model), so an entry never
    # outlives the shape it names; bounded all the same.
    keys_of: dict[tuple[Any, ...], tuple[str, ...]] = {}

    def cached(self: AttributePicker, context: AttributePickerContext) -> tuple[str, ...]:
        shape = context.shape
        # What the names depend on: the picker's alias rules (an attribute of each picker, not of its class), the
        # object's class (and its Meta), the field, its shape and the shape's parent.
        rules = tuple(self.alias_providers)
        key = (type(self), rules, type(context.obj), context.key, shape, getattr(shape, "parent", None))
        found = keys_of.get(key)
        if found is None:
            found = tuple(possible_keys(self, context))
            if len(keys_of) >= _KEYS_MAX:
                keys_of.clear()
            keys_of[key] = found
        return found

    return cached


_modules = moto.backends.list_of_moto_modules


@functools.cache
def _moto_modules() -> tuple[str, ...]:
    return tuple(_modules())


if __name__ == "__main__":
    moto.backends.list_of_moto_modules = _moto_modules
    moto.core.responses.method_names_from_class = functools.cache(moto.core.responses.method_names_from_class)
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    TaggedEC2Resource.get_tags = _tags  # type: ignore[method-assign]
    EC2ContainerServiceBackend.deregister_container_instance = _deregister_known  # type: ignore[method-assign]
    Command.__init__ = _command_for_named  # type: ignore[method-assign]
    for picker in (AttributePicker, XFormedAttributePicker):
        picker.get_possible_keys = _once(picker.get_possible_keys)  # type: ignore[method-assign,assignment]
    main()
