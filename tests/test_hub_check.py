"""``hub_reachable``: a real HTTP request through huggingface_hub's own client, so HF_ENDPOINT, the offline
mode and HTTP(S)_PROXY are honoured as every hub download honours them, and a dead hub is reported fast.

Every server here listens on 127.0.0.1 only. Each check runs in a fresh interpreter: huggingface_hub reads
HF_ENDPOINT, HF_HUB_OFFLINE and the proxy variables once (at import, and when its shared client is built).
"""

from __future__ import annotations

import http.server
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
from helpers import REPO

TIMEOUT_S = 2.0

PROBE = f"""
import json, time
import huggingface_hub  # imported before the clock starts: only the check itself is timed
from finetune.data.loading import hub_reachable
start = time.perf_counter()
ok = hub_reachable(timeout_s={TIMEOUT_S})
print(json.dumps({{"reachable": ok, "seconds": time.perf_counter() - start}}))
"""


def check(**env) -> dict:
    """Run ``hub_reachable`` in a fresh interpreter with ``env`` (no inherited proxy or offline variables)."""
    clean = {k: v for k, v in os.environ.items()
             if k.lower() not in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")
             and k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_ENDPOINT")}
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60,
                            cwd=REPO, env={**clean, **env})
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


class Recorder(http.server.BaseHTTPRequestHandler):
    """Answers every request with ``self.server.status`` and records its request line."""

    def _answer(self):
        self.server.seen.append(self.requestline)
        self.send_response(self.server.status)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_CONNECT = _answer

    def log_message(self, *args):  # keep pytest output clean
        pass


@pytest.fixture
def serve():
    """``serve(status)`` starts a loopback HTTP server answering ``status``; returns (server, its URL)."""
    servers = []

    def start(status: int = 200):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
        server.status, server.seen = status, []
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server, f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_answering_endpoint_is_reachable_and_gets_an_http_request(serve):
    server, url = serve(200)
    result = check(HF_ENDPOINT=url)
    assert result["reachable"] is True
    assert server.seen, "no HTTP request reached the endpoint (a bare TCP connect is not a hub check)"


def test_a_4xx_answer_still_means_the_hub_is_there(serve):
    server, url = serve(404)
    assert check(HF_ENDPOINT=url)["reachable"] is True and server.seen


def test_a_5xx_answer_is_not_a_working_hub(serve):
    server, url = serve(503)
    assert check(HF_ENDPOINT=url)["reachable"] is False and server.seen


def test_a_closed_port_is_unreachable_fast():
    result = check(HF_ENDPOINT=f"http://127.0.0.1:{closed_port()}")
    assert result["reachable"] is False
    assert result["seconds"] < TIMEOUT_S


def test_a_silent_endpoint_is_unreachable_within_the_timeout():
    """A server that accepts the connection and never answers: the check gives up after ~timeout_s."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        result = check(HF_ENDPOINT=f"http://127.0.0.1:{listener.getsockname()[1]}")
    assert result["reachable"] is False
    assert result["seconds"] < TIMEOUT_S + 1.5


@pytest.mark.parametrize("variable", ["HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_offline_mode_says_unreachable_without_a_request(serve, variable):
    server, url = serve(200)
    result = check(HF_ENDPOINT=url, **{variable: "1"})
    assert result["reachable"] is False
    assert result["seconds"] < 0.5
    assert server.seen == []


@pytest.mark.parametrize("variable", ["HTTP_PROXY", "http_proxy"])
def test_http_proxy_carries_the_request(serve, variable):
    """The endpoint's port is closed: only through the proxy (which answers 200 itself) can it succeed."""
    proxy, proxy_url = serve(200)
    endpoint = f"http://127.0.0.1:{closed_port()}"
    result = check(HF_ENDPOINT=endpoint, **{variable: proxy_url})
    assert result["reachable"] is True
    assert proxy.seen and proxy.seen[0].split()[1].startswith(endpoint + "/"), proxy.seen


def test_https_proxy_is_asked_to_connect_to_the_hub(serve):
    """An https endpoint through HTTPS_PROXY: the proxy gets ``CONNECT host:port``; it refuses (502), so
    the hub counts as unreachable, and no connection is made around the proxy."""
    proxy, proxy_url = serve(502)
    port = closed_port()
    result = check(HF_ENDPOINT=f"https://127.0.0.1:{port}", HTTPS_PROXY=proxy_url)
    assert result["reachable"] is False
    assert proxy.seen and proxy.seen[0].startswith(f"CONNECT 127.0.0.1:{port} "), proxy.seen
