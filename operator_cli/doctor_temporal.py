"""`autorepair doctor`'s Temporal checks: the frontend answers, the namespace exists, our search attributes are
registered in it (with their types)."""

from __future__ import annotations

from temporalio.api.enums.v1 import IndexedValueType, NamespaceState
from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
from temporalio.api.workflowservice.v1 import DescribeNamespaceRequest
from temporalio.service import RPCError, RPCStatusCode

from contract import search_attributes
from operator_cli.client import OpsError, connect_client, one_line
from operator_cli.doctor_checks import Doctor, Verdict, failed, passed, skipped

# The server would not say: a Temporal Cloud API key scoped to its namespace may not read the namespace's settings.
_CANNOT_ASK = (RPCStatusCode.PERMISSION_DENIED, RPCStatusCode.UNIMPLEMENTED, RPCStatusCode.UNAUTHENTICATED)


def _type_name(value: int) -> str:
    return IndexedValueType.Name(IndexedValueType.ValueType(value)).removeprefix("INDEXED_VALUE_TYPE_").title()


async def temporal_reachable(doc: Doctor) -> Verdict:
    try:
        doc.client = await connect_client(doc.temporal)
    except OpsError as err:
        return failed(
            str(err),
            "start Temporal there, or point doctor and the worker at it: --address, temporal.address "
            "(AUTOREPAIR_TEMPORAL__ADDRESS) or TEMPORAL_ADDRESS; TLS and API key as in docs/operations.md section 0",
        )
    tls = " over TLS" if doc.temporal.tls or doc.temporal.api_key or doc.temporal.tls_server_ca else ""
    return passed(f"{doc.temporal.address} answered{tls}")


async def namespace_exists(doc: Doctor) -> Verdict:
    namespace = doc.temporal.namespace
    if doc.client is None:
        return skipped("Temporal did not answer")
    try:
        found = await doc.client.workflow_service.describe_namespace(DescribeNamespaceRequest(namespace=namespace))
    except RPCError as err:
        if err.status == RPCStatusCode.NOT_FOUND:
            return failed(
                f"no namespace {namespace!r} on {doc.temporal.address}",
                f"create it (temporal operator namespace create --namespace {namespace}; on Temporal Cloud in its "
                "UI), or name the one the worker uses: -n, temporal.namespace or TEMPORAL_NAMESPACE",
            )
        if err.status in _CANNOT_ASK:
            doc.namespace_found = True  # not known missing: the search attributes are still worth asking for
            return skipped(f"Temporal would not describe namespace {namespace!r}: {one_line(err.message)}")
        raise
    state = found.namespace_info.state
    if state != NamespaceState.NAMESPACE_STATE_REGISTERED:
        return failed(
            f"namespace {namespace!r} is {NamespaceState.Name(state).removeprefix('NAMESPACE_STATE_').lower()}",
            "use a registered namespace: -n, temporal.namespace or TEMPORAL_NAMESPACE",
        )
    doc.namespace_found = True
    return passed(f"namespace {namespace!r} is registered")


async def search_attributes_registered(doc: Doctor) -> Verdict:
    if doc.client is None or not doc.namespace_found:
        return skipped("Temporal did not answer" if doc.client is None else "the namespace is missing")
    namespace = doc.temporal.namespace
    try:
        existing = await doc.client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=namespace)
        )
    except RPCError as err:
        if err.status in _CANNOT_ASK:
            return skipped(f"Temporal would not list the search attributes: {one_line(err.message)}")
        raise
    registered = dict(existing.custom_attributes)
    missing = [key for key in search_attributes.ALL if key.name not in registered]
    wrong = [
        f"{key.name} is {_type_name(registered[key.name])}, not {_type_name(int(key.indexed_value_type))}"
        for key in search_attributes.ALL
        if key.name in registered and registered[key.name] != int(key.indexed_value_type)
    ]
    if missing:
        names = ", ".join(f"{key.name} ({_type_name(int(key.indexed_value_type))})" for key in missing)
        return failed(
            f"namespace {namespace!r} lacks {names}",
            "run `autorepair setup` (it registers them; the worker does too when it starts, where it may), or on "
            "Temporal Cloud add them in the namespace's settings",
        )
    if wrong:
        return failed(
            f"namespace {namespace!r}: {'; '.join(wrong)}",
            "a search attribute's type cannot change: remove it (temporal operator search-attribute remove) and run "
            "`autorepair setup`",
        )
    return passed(f"all {len(search_attributes.ALL)} registered in {namespace!r}")
