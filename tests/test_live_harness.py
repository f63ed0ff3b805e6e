"""The live tier's server harness (tests/live/server.py) on its own, with stand-in servers: the ports it gives its
servers, and a start whose port was taken in the meantime. (The tier itself, with real SGLang: test_live_sglang.py.)"""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.live import server as live


def ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def test_server_ports_are_drawn_below_the_ephemeral_range_and_bind():
    """``bind(0)`` hands out ephemeral ports, which any outgoing connection may take before a server binds its port
    (tens of seconds after it is drawn): the harness draws below that range, at random, ports that bind now."""
    ports = [live.free_port() for _ in range(20)]
    assert all(live.PORTS.start <= p < live.PORTS.stop and p < ephemeral_low() for p in ports), ports
    assert len(set(ports)) > 1, "drawn at random, not the same port each time"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports[-1]))


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The harness starting tests/live_fake_server.py (SGLang's log lines, /health) in place of SGLang."""
    monkeypatch.setattr(live, "ENTRIES", {True: "tests.live_fake_server", False: "tests.live_fake_server"})
    monkeypatch.setattr(live, "models", lambda root: {name: tmp_path / name for name in ("target", "eagle", "eagle3")})
    return tmp_path


def test_a_server_whose_port_was_taken_starts_again_on_another(stand_in, monkeypatch):
    """CI, once: the port drawn for a server was taken by the time the server bound it, and the server died with
    "address already in use". The harness starts it again on a fresh port; the other starts are not repeated."""
    with socket.create_server(("127.0.0.1", 0)) as taken:
        draws = iter([taken.getsockname()[1]])
        real = live.free_port
        monkeypatch.setattr(live, "free_port", lambda: next(draws, None) or real())
        with live.LiveServer.start([], stand_in, name="moved", timeout=60) as server:
            assert server.port != taken.getsockname()[1]
            assert server.client.health()
            assert server.process.poll() is None


def test_a_server_that_dies_for_another_reason_is_not_started_again(stand_in, monkeypatch):
    """Only a taken port earns a new start: any other death fails at once with the server's own error line."""
    starts = []
    real = live.free_port
    monkeypatch.setattr(live, "free_port", lambda: starts.append(1) or real())
    monkeypatch.setenv("FAKE_SERVER_FAIL", "float32")  # the stand-in dies at start on --dtype float32
    monkeypatch.setattr(live, "BASE_ARGS", ("--dtype", "float32"))
    with pytest.raises(RuntimeError, match="stand-in start failure"):
        live.LiveServer.start([], stand_in, name="dies", timeout=60)
    assert len(starts) == 1
