"""Reading a /metrics page as Prometheus does: fetched over HTTP, parsed by prometheus_client's own parser."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def parse(text: str) -> list[Sample]:
    """Every sample on the page (a counter's as `<name>_total`, a histogram's as `_bucket`, `_count`, `_sum`)."""
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def total(samples: list[Sample], name: str, **labels: str) -> float:
    """Sum over every series of `name` whose labels include `labels` (other labels, e.g. task_queue, vary)."""
    return sum(
        s.value for s in samples if s.name == name and all(s.labels.get(k) == want for k, want in labels.items())
    )


def has_series(samples: list[Sample], name: str, **labels: str) -> bool:
    """Whether a series of `name` with these labels is there, whatever its value (a gauge at 0 included)."""
    return any(s.name == name and all(s.labels.get(k) == v for k, v in labels.items()) for s in samples)


def fetch(url: str) -> tuple[int, str, str]:
    """Status, Content-Type and body of a GET (an HTTP error's too). Blocking: run it in a thread."""
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return response.status, response.headers.get("Content-Type", ""), response.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type", ""), err.read().decode()


async def scrape(url: str) -> list[Sample]:
    """The samples a scrape of `url` (a /metrics URL) reads now; it must answer 200 in Prometheus' text format."""
    status, content_type, text = await asyncio.to_thread(fetch, url)
    assert status == 200, (status, text)
    assert content_type.startswith("text/plain"), content_type
    return parse(text)
