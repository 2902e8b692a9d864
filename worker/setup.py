"""One-time namespace set-up: the custom search attributes the Web UI filters repairs by."""

from __future__ import annotations

import structlog
from temporalio.api.enums.v1 import IndexedValueType
from temporalio.api.operatorservice.v1 import AddSearchAttributesRequest, ListSearchAttributesRequest
from temporalio.client import Client

from contract import search_attributes

log = structlog.get_logger(__name__)


async def ensure_search_attributes(client: Client) -> list[str]:
    """Register whichever of our search attributes the namespace lacks; returns the names it added."""
    existing = await client.operator_service.list_search_attributes(
        ListSearchAttributesRequest(namespace=client.namespace)
    )
    missing = {
        key.name: IndexedValueType.ValueType(int(key.indexed_value_type))
        for key in search_attributes.ALL
        if key.name not in existing.custom_attributes
    }
    if missing:
        await client.operator_service.add_search_attributes(
            AddSearchAttributesRequest(namespace=client.namespace, search_attributes=missing)
        )
        log.info("registered search attributes", names=sorted(missing))
    return sorted(missing)
