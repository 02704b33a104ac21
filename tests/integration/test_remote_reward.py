"""Remote rewards through the real CLI.

- A remote reward service (a real HTTP server in this test, answering with the rule and
  failing now and then with a 500) is the only reward of a short run that learns; the token
  travels in its header.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from streamrl.reward.rule import arith_exact_match
from tests.integration.conftest import learning_run

pytestmark = [pytest.mark.integration]


class _RuleService(BaseHTTPRequestHandler):
    """The rule reward as a remote service: bearer token required; every 7th request fails
    with a 500 (the client retries it)."""

    token = "s3cret"
    lock = threading.Lock()
    requests = 0
    failed = 0
    samples = 0
    authorised = 0

    def do_POST(self) -> None:  # noqa: N802 - the http.server API
        cls = type(self)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with cls.lock:
            cls.requests += 1
            failing = cls.requests % 7 == 0
            cls.authorised += self.headers.get("Authorization") == f"Bearer {cls.token}"
        if self.headers.get("Authorization") != f"Bearer {cls.token}":
            return self._send(401, {"error": "bad token"})
        if failing:
            with cls.lock:
                cls.failed += 1
            return self._send(500, {"error": "try again"})
        results = []
        for sample in body["samples"]:
            r = arith_exact_match(sample["response"], sample["answer"])
            results.append(
                {"score": r.value, "status": r.status, "reason": r.reason}
                if r.status != "ok"
                else r.value
            )
        with cls.lock:
            cls.samples += len(results)
        self._send(200, {"results": results})

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        return None


def test_a_remote_reward_alone_trains_the_policy(tmp_path, monkeypatch) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RuleService)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setenv("STREAMRL_REWARD_TOKEN", _RuleService.token)
    try:
        summary, steps = learning_run(
            tmp_path / "remote",
            "runtime.mode=threads",
            "reward.function=[]",
            "reward.eval_function=streamrl.reward.rule:arith_exact_match",
            f"reward.remote.url=http://127.0.0.1:{server.server_port}/score",
            "reward.remote.backoff_s=0.05",
            "rollout.batch_prompts=16",
            "data.num_eval=64",
            steps=6,
        )
    finally:
        server.shutdown()
    assert summary["final_eval_accuracy"] >= 0.75, summary
    assert _RuleService.authorised == _RuleService.requests > 0  # the token in every request
    assert _RuleService.failed >= 1  # some 500s, each retried: nothing dropped for them
    assert _RuleService.samples >= 6 * 16 * 8  # every trained sample was scored remotely
    assert not summary["num_samples_dropped"].get("infra_error")
