"""loadtest/quiet_peers.py on real processes: the peer's listener is found through /proc, its
process group is stopped and continued, and nothing is left stopped when the block ends."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from loadtest.quiet_peers import QuietPeers, listening_inodes, listening_pid

LISTENER = """
import socket, sys, time
server = socket.create_server(("127.0.0.1", 0))
print(server.getsockname()[1], flush=True)
time.sleep(120)
"""


def state(pid: int) -> str:
    """The process's state letter in /proc: S sleeping, T stopped."""
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().rsplit(")", 1)[1].split()[0]


def wait_for_state(pid: int, wanted: str) -> str:
    deadline = time.monotonic() + 5
    while state(pid) != wanted and time.monotonic() < deadline:
        time.sleep(0.01)
    return state(pid)


@pytest.fixture
def peer():
    """(pid, url) of a listening process in a session of its own, as `setsid` starts one."""
    process = subprocess.Popen(
        [sys.executable, "-c", LISTENER], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    port = int(process.stdout.readline())
    yield process.pid, f"http://127.0.0.1:{port}"
    os.killpg(process.pid, 9)
    process.wait(10)


def test_the_listening_process_is_found() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    try:
        assert listening_pid(server.getsockname()[1]) == os.getpid()
    finally:
        server.close()
    unused = socket.socket()
    unused.bind(("127.0.0.1", 0))  # bound, not listening
    try:
        assert listening_pid(unused.getsockname()[1]) is None
    finally:
        unused.close()


def test_a_peer_is_stopped_for_other_targets_and_continued_for_its_own(peer) -> None:
    pid, url = peer
    with QuietPeers({"other": url}) as quiet:
        assert quiet.groups == {"other": pid}
        quiet.only(None)  # one of tandem's targets runs
        assert wait_for_state(pid, "T") == "T"
        quiet.only("other")  # its own rounds
        assert wait_for_state(pid, "S") == "S"
        quiet.only(None)
        assert wait_for_state(pid, "T") == "T"
    assert wait_for_state(pid, "S") == "S"  # nothing is left stopped


def test_paused_peers_are_continued_when_the_run_fails(peer) -> None:
    pid, url = peer
    with pytest.raises(RuntimeError), QuietPeers({"other": url}) as quiet:
        quiet.only(None)
        assert wait_for_state(pid, "T") == "T"
        raise RuntimeError("a round failed")
    assert wait_for_state(pid, "S") == "S"


def test_a_peer_in_this_process_group_is_never_stopped(capsys) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    try:
        with QuietPeers({"mine": f"http://127.0.0.1:{server.getsockname()[1]}"}) as quiet:
            quiet.only(None)  # would stop this test's own process
            assert quiet.groups == {}
    finally:
        server.close()
    assert "shares this benchmark's process group" in capsys.readouterr().err


def test_disabled_leaves_peers_alone(peer) -> None:
    pid, url = peer
    with QuietPeers({"other": url}, enabled=False) as quiet:
        quiet.only(None)
        assert quiet.groups == {}
        time.sleep(0.05)
        assert state(pid) == "S"


def test_only_a_listener_a_loopback_client_reaches_counts(tmp_path) -> None:
    """A socket on the peer's port of another address (a Ray worker on the node's IP, say) is
    not the peer."""
    (tmp_path / "net").mkdir()
    header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"  # noqa: E501

    def row(local: str, state: str, inode: int) -> str:
        return f"   0: {local} 00000000:0000 {state} 00000000:00000000 00:00000000 00000000  0  0 {inode}\n"  # noqa: E501

    (tmp_path / "net" / "tcp").write_text(
        header
        + row("0500000A:1F90", "0A", 11)  # 10.0.0.5:8080, listening: another address
        + row("0100007F:1F90", "0A", 12)  # 127.0.0.1:8080, listening
        + row("00000000:1F90", "0A", 13)  # 0.0.0.0:8080, listening
        + row("0100007F:1F91", "0A", 14)  # another port
        + row("0100007F:1F90", "01", 15)  # established, not listening
    )
    (tmp_path / "net" / "tcp6").write_text(
        header
        + row("00000000000000000000000001000000:1F90", "0A", 21)  # [::1]:8080
        + row("0000000000000000FFFF00000100007F:1F90", "0A", 22)  # [::ffff:127.0.0.1]:8080
        + row("00000000000000000000000000000000:1F90", "0A", 23)  # [::]:8080
        + row("B80D0120000000000000000001000000:1F90", "0A", 24)  # [2001:db8::1]:8080
    )
    assert listening_inodes(8080, tmp_path) == {"12", "13", "21", "22", "23"}
