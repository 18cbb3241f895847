"""`tandem pool` against a real HTTP server whose Coordinator drives fake workers: what it prints,
that --wait returns only once the pools match, and its failures as one line with exit 1."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

from cli.main import main
from tests.support.fake_workers import FakeDecodeActor, served_fake_cluster

KEY = "pool-secret"


@pytest.fixture
def server_url(monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)
    with served_fake_cluster(monkeypatch, KEY) as (_, url):
        yield url


def pool(url: str, *args: str, key: str = KEY) -> int:
    return main(["pool", *args, "--base-url", url, "--api-key", key])


def serving(url: str, pool_name: str) -> list[str]:
    """Straight from the server, not through the command under test."""
    reply = httpx.get(f"{url}/admin/pools", headers={"Authorization": f"Bearer {KEY}"})
    workers = reply.json()["workers"]
    return sorted(w["id"] for w in workers if w["pool"] == pool_name and w["state"] == "serving")


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    return lines[0]


def test_list_shows_every_worker_and_the_restarts(server_url, capsys) -> None:
    assert pool(server_url, "list") == 0
    table = capsys.readouterr().out.splitlines()
    assert table[0].split() == ["ID", "POOL", "STATE", "RUNNING", "WAITING", "KV", "USAGE"]
    assert [row.split()[:3] for row in table[1:3]] == [
        ["decode-0", "decode", "serving"],
        ["prefill-0", "prefill", "serving"],
    ]
    assert table[3] == "restarts: decode 0, prefill 0"


def test_list_json_is_the_servers_view(server_url, capsys, monkeypatch) -> None:
    monkeypatch.setenv("TANDEM_API_KEY", KEY)  # the default for --api-key
    assert main(["pool", "list", "--base-url", server_url, "--json"]) == 0
    view = json.loads(capsys.readouterr().out)
    assert sorted(w["id"] for w in view["workers"]) == ["decode-0", "prefill-0"]
    assert view["restarts"] == {"prefill": 0, "decode": 0}


def test_an_openai_sdk_base_url_reaches_the_admin_routes(server_url, capsys) -> None:
    assert pool(server_url + "/v1/", "list", "--json") == 0  # not /v1/admin/pools
    assert len(json.loads(capsys.readouterr().out)["workers"]) == 2


def test_scale_and_drain_wait_until_done(server_url, capsys) -> None:
    assert pool(server_url, "scale", "--decode", "2", "--wait", "5") == 0
    assert serving(server_url, "decode") == ["decode-0", "decode-new0"]
    assert "decode-new0" in capsys.readouterr().out
    assert pool(server_url, "drain", "decode-0", "--wait", "5") == 0
    assert serving(server_url, "decode") == ["decode-new0"]
    assert "decode-0 " not in capsys.readouterr().out
    assert pool(server_url, "scale", "--decode", "2", "--wait", "5") == 0
    assert pool(server_url, "scale", "--decode", "1", "--wait", "5") == 0
    assert "draining" not in capsys.readouterr().out  # done once the drained worker has left


def test_wait_gives_up_with_one_line(server_url, capsys, monkeypatch) -> None:
    async def never_loads(self) -> int:
        await asyncio.Event().wait()
        return 0

    monkeypatch.setattr(FakeDecodeActor, "ping", never_loads)  # new workers stay "starting"
    assert pool(server_url, "scale", "--decode", "2", "--wait", "0.3") == 1
    line = one_error_line(capsys)
    assert "gave up after 0.3s" in line and "decode has 1 serving workers, not 2" in line


def test_a_wrong_key_is_one_line_about_the_key(server_url, capsys) -> None:
    assert pool(server_url, "list", key="wrong") == 1
    line = one_error_line(capsys)
    assert "HTTP 401" in line and "API key" in line


def test_the_servers_refusal_is_one_line(server_url, capsys) -> None:
    assert pool(server_url, "scale", "--decode", "0") == 1
    assert "the decode pool needs at least 1 worker" in one_error_line(capsys)
    assert pool(server_url, "drain", "nobody") == 1
    assert "HTTP 404: no worker 'nobody'" in one_error_line(capsys)
    assert pool(server_url, "scale") == 1
    assert "--decode" in one_error_line(capsys)


def test_an_unreachable_server_is_one_line(capsys) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    assert pool(f"http://127.0.0.1:{port}", "list") == 1
    assert f"cannot reach http://127.0.0.1:{port}" in one_error_line(capsys)


def test_role_moves_a_worker_between_pools(server_url, capsys) -> None:
    assert pool(server_url, "scale", "--decode", "2", "--wait", "5") == 0
    capsys.readouterr()
    assert pool(server_url, "role", "decode-0", "prefill") == 0
    assert "decode-0 serves as prefill after" in capsys.readouterr().out
    assert serving(server_url, "prefill") == ["decode-0", "prefill-0"]
    assert pool(server_url, "role", "decode-new0", "prefill") == 1
    assert "decode pool would be empty" in one_error_line(capsys)
