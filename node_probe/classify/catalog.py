"""NVIDIA's Xid catalog (code -> mnemonic and resolution bucket), shipped as package data.

The table is NVIDIA's own classification, reduced to what a repair policy needs, plus which Xids ECS and EKS
act on. It is loaded once per process and never mutated.
"""

from __future__ import annotations

import csv
import functools
import io
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType

CATALOG_RESOURCE = "xid_catalog.tsv"
# ECS documents exactly this many Xids; a different count means the table was edited wrongly.
ECS_XID_COUNT = 18


@dataclass(frozen=True, slots=True)
class XidInfo:
    code: int
    mnemonic: str
    description: str
    immediate_bucket: str  # "" = not yet assigned by NVIDIA
    investigatory_bucket: str
    h100: bool
    gb200: bool
    ecs_replaces: bool
    eks_fatal: bool


class XidCatalog:
    """Read-only lookup by Xid code."""

    def __init__(self, entries: Mapping[int, XidInfo]) -> None:
        self._entries: Mapping[int, XidInfo] = MappingProxyType(dict(entries))
        self.ecs_codes: frozenset[int] = frozenset(c for c, info in self._entries.items() if info.ecs_replaces)

    @classmethod
    def from_text(cls, text: str) -> XidCatalog:
        rows = (line for line in io.StringIO(text) if line.strip() and not line.startswith("#"))
        entries: dict[int, XidInfo] = {}
        for row in csv.DictReader(rows, delimiter="\t"):
            code = int(row["code"])
            entries[code] = XidInfo(
                code=code,
                mnemonic=row["mnemonic"],
                description=row["description"],
                immediate_bucket=row["immediate_bucket"].strip(),
                investigatory_bucket=row["investigatory_bucket"].strip(),
                h100=row["h100"] == "YES",
                gb200=row["gb200"] == "YES",
                ecs_replaces=row["ecs_replaces"] == "yes",
                eks_fatal=row["eks_fatal"] == "yes",
            )
        return cls(entries)

    def get(self, code: int) -> XidInfo | None:
        return self._entries.get(code)

    def __contains__(self, code: object) -> bool:
        return code in self._entries

    def __iter__(self) -> Iterator[XidInfo]:
        return iter(self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)


@functools.cache
def default_catalog() -> XidCatalog:
    """The catalog shipped with the package (cached: it is immutable, so sharing it is safe)."""
    text = resources.files(__package__).joinpath(CATALOG_RESOURCE).read_text(encoding="utf-8")
    catalog = XidCatalog.from_text(text)
    if len(catalog.ecs_codes) != ECS_XID_COUNT:
        raise RuntimeError(
            f"{CATALOG_RESOURCE}: expected {ECS_XID_COUNT} Xids in ecs_replaces, found {len(catalog.ecs_codes)}"
        )
    return catalog
