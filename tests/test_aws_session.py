"""Every part's boto3 session is its own, but the service models behind it are read once a process."""

from __future__ import annotations

from typing import Any

import pytest
from botocore.loaders import JSONFileLoader

from contract.aws_session import new_session, service_models


def test_a_second_session_reads_no_model_again_and_keeps_its_own_region(monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[str] = []
    original = JSONFileLoader.load_file

    def counting(self: JSONFileLoader, file_path: str) -> object:
        read.append(file_path)
        return original(self, file_path)

    monkeypatch.setattr(JSONFileLoader, "load_file", counting)
    kwargs: dict[str, Any] = {
        "endpoint_url": "http://127.0.0.1:1",
        "aws_access_key_id": "x",
        "aws_secret_access_key": "y",
    }
    first = new_session("us-east-1").client("ec2", **kwargs)
    read.clear()

    second = new_session("eu-west-1").client("ec2", **kwargs)

    assert read == []
    assert (first.meta.region_name, second.meta.region_name) == ("us-east-1", "eu-west-1")
    assert first is not second


def test_sessions_do_not_grow_the_models_search_path() -> None:
    new_session("us-east-1")
    before = list(service_models().search_paths)
    sessions = [new_session(None) for _ in range(50)]
    assert service_models().search_paths == before
    assert "ec2" in sessions[-1].get_available_services()
