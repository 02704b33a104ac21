"""The remote reward client against a real HTTP server run here (`streamrl.reward.remote`).

The server (stdlib `ThreadingHTTPServer` on 127.0.0.1) answers from a script a test sets, a queue
of replies and a default for when it runs dry, and records every request it gets: headers, body,
arrival time and the most requests it held at once. Nothing of the client is mocked.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from streamrl.reward.remote import RemoteReward, RemoteSettings
from streamrl.reward.sandbox import ScoreTask

PROXY_VARIABLES = (
    "http_proxy",
    "HTTP_PROXY",
    "https_proxy",
    "HTTPS_PROXY",
    "all_proxy",
    "ALL_PROXY",
)


@dataclass
class Reply:
    status: int = 200
    body: Any = None
    """bytes or str sent as they are, anything else as JSON; None scores each sample by the length
    of its response."""
    headers: dict[str, str] = field(default_factory=dict)
    wait: Callable[[], None] | None = None
    """Called before replying (hold the request in flight)."""


@dataclass
class Seen:
    headers: dict[str, str]
    body: Any
    arrived: float


class ScriptedServer:
    """Replies from `script`, then from `respond`; records what it gets in `seen`."""

    def __init__(self) -> None:
        self.script: deque[Reply] = deque()
        self.respond: Callable[[Seen], Reply] = lambda seen: Reply()
        self.seen: list[Seen] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.released = threading.Event()
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.scripted = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def hold(self) -> None:
        """Keep a request unanswered until the test ends (the client times out first)."""
        self.released.wait(timeout=5)

    def close(self) -> None:
        self.released.set()
        self.httpd.shutdown()
        self.httpd.server_close()


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        server: ScriptedServer = self.server.scripted  # type: ignore[attr-defined]
        raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        seen = Seen(dict(self.headers), json.loads(raw), time.monotonic())
        with server.lock:
            server.seen.append(seen)
            server.in_flight += 1
            server.max_in_flight = max(server.max_in_flight, server.in_flight)
            reply = server.script.popleft() if server.script else server.respond(seen)
        try:
            if reply.wait is not None:
                reply.wait()
        finally:
            # Out of flight before the reply leaves: the client may send its next request as
            # soon as it has this one's answer.
            with server.lock:
                server.in_flight -= 1
        body = reply.body
        if body is None:
            body = {"results": [float(len(s["response"])) for s in seen.body["samples"]]}
        if not isinstance(body, (bytes, str)):
            body = json.dumps(body)
        data = body.encode() if isinstance(body, str) else body
        try:
            self.send_response(reply.status)
            for name, value in {"Content-Type": "application/json", **reply.headers}.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            pass  # the client gave up on this request (its timeout); nothing to answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def server() -> Iterator[ScriptedServer]:
    scripted = ScriptedServer()
    yield scripted
    scripted.close()


@pytest.fixture
def make_reward() -> Iterator[Callable[..., RemoteReward]]:
    made: list[RemoteReward] = []

    def make(url: str, **settings: Any) -> RemoteReward:
        fast = {"timeout_s": 2.0, "max_retries": 2, "backoff_s": 0.01, "max_backoff_s": 0.05}
        reward = RemoteReward(RemoteSettings(url, **{**fast, **settings}))
        made.append(reward)
        return reward

    yield make
    for reward in made:
        reward.close()


def tasks(n: int) -> list[ScoreTask]:
    return [ScoreTask("x" * (i + 1), str(i), {"index": i}, prompt=f"p{i}") for i in range(n)]


def test_scores_numbers_and_objects_in_order(server, make_reward) -> None:
    server.script.append(
        Reply(
            body={
                "results": [
                    1,
                    {"score": 0.5, "reason": "close", "components": {"acc": 1, "fmt": -0.5}},
                    {"score": None, "status": "invalid_output", "reason": "no answer"},
                    {"score": 2.5, "status": "ok"},
                ]
            }
        )
    )
    sent = tasks(3) + [ScoreTask("r", "a", prompt=[{"role": "user", "content": "hi"}])]
    reward = make_reward(server.url)
    results = reward.score(sent)

    assert [(r.value, r.status) for r in results] == [
        (1.0, "ok"),
        (0.5, "ok"),
        (None, "invalid_output"),
        (2.5, "ok"),
    ]
    assert results[1].components == {"acc": 1.0, "fmt": -0.5} and results[1].reason == "close"
    assert results[2].reason == "no answer"
    (request,) = server.seen
    assert request.headers["Content-Type"] == "application/json"
    assert "Authorization" not in request.headers
    assert request.body["samples"][0] == {
        "prompt": "p0",
        "response": "x",
        "answer": "0",
        "extra": {"index": 0},
    }
    assert request.body["samples"][3]["prompt"] == [{"role": "user", "content": "hi"}]
    assert reward.name == "remote"
    counters = reward.counters()
    assert counters["requests"] == 1 and counters["retries"] == 0 and counters["samples"] == 4
    assert counters["failures/invalid_output"] == 1 and counters["failures/infra_error"] == 0


def test_batches_go_out_concurrently_up_to_the_limit(server, make_reward) -> None:
    both_in = threading.Barrier(2, timeout=2)

    def together() -> None:
        try:
            both_in.wait()
        except threading.BrokenBarrierError:
            return  # the client sent one at a time: max_in_flight says so below
        time.sleep(0.02)  # room for a third request, were the client to send one

    server.script.extend([Reply(wait=together), Reply(wait=together)])
    reward = make_reward(server.url, concurrency=2, batch_size=2)
    results = reward.score(tasks(9))

    assert [r.value for r in results] == [float(i + 1) for i in range(9)]
    assert sorted(len(s.body["samples"]) for s in server.seen) == [1, 2, 2, 2, 2]
    assert server.max_in_flight == 2


def test_sends_the_token_and_keeps_it_out_of_reasons(server, make_reward) -> None:
    def check_token(seen: Seen) -> Reply:
        auth = seen.headers.get("Authorization", "")
        if auth == "Bearer right-token":
            return Reply()
        return Reply(401, f"bad credentials {auth}")  # a careless service echoes the header

    server.respond = check_token
    assert make_reward(server.url, token="right-token").score(tasks(1))[0].value == 1.0

    reward = make_reward(server.url, token="wrong-token")
    (result,) = reward.score(tasks(1))
    assert result.status == "infra_error" and result.value is None
    assert f"HTTP 401 from {server.url}: bad credentials Bearer <token>" == result.reason
    assert len(server.seen) == 2  # one attempt each: a 401 is not retried
    assert reward.counters()["retries"] == 0
    assert "wrong-token" not in repr(reward.settings)


@pytest.mark.parametrize("status", [500, 503, 429, 408])
def test_retries_infrastructure_errors(server, make_reward, status: int) -> None:
    server.script.extend([Reply(status, "busy"), Reply()])
    reward = make_reward(server.url)
    results = reward.score(tasks(2))

    assert [(r.value, r.status) for r in results] == [(1.0, "ok"), (2.0, "ok")]
    assert len(server.seen) == 2
    assert reward.counters()["requests"] == 2 and reward.counters()["retries"] == 1


def test_gives_up_after_the_retries_with_backoff(server, make_reward) -> None:
    server.respond = lambda seen: Reply(500, "database down")
    reward = make_reward(server.url, max_retries=2, backoff_s=0.05, max_backoff_s=1.0)
    results = reward.score(tasks(3))

    assert {(r.value, r.status) for r in results} == {(None, "infra_error")}
    assert results[0].reason == (
        f"HTTP 500 from {server.url}: database down; gave up after 3 attempts"
    )
    arrived = [s.arrived for s in server.seen]
    assert len(arrived) == 3
    assert arrived[1] - arrived[0] >= 0.05 and arrived[2] - arrived[1] >= 0.1
    counters = reward.counters()
    assert counters["requests"] == 3 and counters["retries"] == 2
    assert counters["failures/infra_error"] == 3


def test_a_client_error_is_not_retried(server, make_reward) -> None:
    body = "field 'samples' is malformed " + "y" * 500
    server.respond = lambda seen: Reply(400, body)
    reward = make_reward(server.url)
    results = reward.score(tasks(2))

    assert {r.status for r in results} == {"infra_error"}
    assert results[0].reason == f"HTTP 400 from {server.url}: {body[:200]}"
    assert len(server.seen) == 1 and reward.counters()["retries"] == 0


def test_a_timeout_is_retried_then_reported(server, make_reward) -> None:
    server.respond = lambda seen: Reply(wait=server.hold)
    reward = make_reward(server.url, timeout_s=0.2, max_retries=1)
    started = time.monotonic()
    results = reward.score(tasks(2))

    assert {(r.value, r.status) for r in results} == {(None, "timeout")}
    assert results[0].reason == (
        f"no reply from {server.url} within 0.2 s; gave up after 2 attempts"
    )
    assert len(server.seen) == 2
    assert time.monotonic() - started < 2.0
    assert reward.counters()["failures/timeout"] == 2


def test_the_last_failure_names_the_status(server, make_reward) -> None:
    server.script.extend([Reply(wait=server.hold), Reply(502, "bad gateway")])
    (result,) = make_reward(server.url, timeout_s=0.2, max_retries=1).score(tasks(1))
    assert result.status == "infra_error"
    assert result.reason.startswith(f"HTTP 502 from {server.url}")


def test_connection_refused_is_an_infra_error_after_the_retries(make_reward) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    reward = make_reward(url, max_retries=2)
    results = reward.score(tasks(2))

    assert {(r.value, r.status) for r in results} == {(None, "infra_error")}
    assert results[0].reason.startswith(f"cannot reach {url}: ")
    assert results[0].reason.endswith("gave up after 3 attempts")
    assert reward.counters()["requests"] == 3 and reward.counters()["retries"] == 2


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (b"<html>oops</html>", "is not JSON"),
        ({"scores": [1, 2]}, 'is not an object with a "results" list'),
        ([1, 2], 'is not an object with a "results" list'),
        ({"results": [1]}, "has 1 results for 2 samples"),
    ],
)
def test_a_bad_reply_fails_the_batch_without_retry(
    server, make_reward, body: Any, expected: str
) -> None:
    server.respond = lambda seen: Reply(body=body)
    results = make_reward(server.url).score(tasks(2))

    assert {(r.value, r.status) for r in results} == {(None, "infra_error")}
    assert results[0].reason.startswith(f"reply from {server.url} {expected}")
    assert len(server.seen) == 1


def test_a_bad_result_fails_its_sample_only(server, make_reward) -> None:
    body = (
        b'{"results": [1, NaN, "high", {"score": null}, {"status": "great", "score": 1},'
        b' true, 1e400, {"score": 1, "components": {"a": "x"}}, 1' + b"0" * 400 + b"]}"
    )
    server.respond = lambda seen: Reply(body=body)
    results = make_reward(server.url).score(tasks(9))

    assert [r.status for r in results] == ["ok"] + ["infra_error"] * 8
    reasons = [
        r.reason.removeprefix(f"result {i} from {server.url} ") for i, r in enumerate(results)
    ]
    assert reasons[1:] == [
        "has the score nan, not a finite number, with status ok",
        "is a str",
        "has the score None, not a finite number, with status ok",
        "has the status 'great'; expected 'ok' or 'invalid_output'",
        "is a bool",
        "has the score inf, not a finite number, with status ok",
        "has the component 'a' = 'x', not a finite number",
        "has the score " + ("1" + "0" * 400)[:40] + ", not a finite number, with status ok",
    ]


def test_redirects_are_not_followed(server, make_reward) -> None:
    server.respond = lambda seen: Reply(302, "", headers={"Location": "http://elsewhere/"})
    (result,) = make_reward(server.url, token="t0k3n").score(tasks(1))
    assert result.status == "infra_error"
    assert "HTTP 302" in result.reason and "redirects are not followed" in result.reason
    assert len(server.seen) == 1


def test_a_sample_that_is_not_json_is_an_infra_error(server, make_reward) -> None:
    sent = [ScoreTask("r", "a", {"when": object()})]
    (result,) = make_reward(server.url).score(sent)
    assert result.status == "infra_error" and "as JSON" in result.reason
    assert server.seen == []


def test_no_tasks_no_request_and_closed_refuses(server, make_reward) -> None:
    reward = make_reward(server.url)
    assert reward.score([]) == []
    assert server.seen == []
    reward.close()
    with pytest.raises(RuntimeError, match="closed"):
        reward.score(tasks(1))


@pytest.mark.parametrize(
    "url", ["ftp://host/score", "localhost:8000/score", "http://", "/score", "http://h:99999/"]
)
def test_a_url_that_is_not_http_is_refused(url: str) -> None:
    with pytest.raises(ValueError, match="is not an http:// or https:// URL") as raised:
        RemoteSettings(url)
    assert repr(url) in str(raised.value)


@pytest.mark.parametrize(
    "settings",
    [{"concurrency": 0}, {"batch_size": 0}, {"timeout_s": 0}, {"max_retries": -1}],
)
def test_settings_out_of_range_are_refused(settings: dict[str, Any]) -> None:
    name = next(iter(settings))
    with pytest.raises(ValueError, match=name):
        RemoteSettings("https://reward.example/score", **settings)
