"""Scoring with a remote reward service: a reward someone else runs, reached over HTTP.

`RemoteReward.score(tasks)` cuts the tasks into batches of `batch_size` samples and posts each
batch to the service, with at most `concurrency` requests in flight (stdlib threads, one request a
thread); the results come back one a task, in the tasks' order:

    score(tasks) ──batch 0──► POST url ──200 {"results": [...]}──► check ──► results
                 ──batch 1──► POST url ──5xx / 429 / 408 / timeout ──► back off, retry
                 ──batch 2──► POST url ──other 4xx, bad reply ──► infra_error, no retry

Wire format (the contract a service implements):

- Request: `POST <url>` with `Content-Type: application/json`, `Authorization: Bearer <token>`
  when a token is set, and the body

      {"samples": [{"prompt": str | [message, ...] | null, "response": str, "answer": str,
                    "extra": {...}}, ...]}

- Reply `200` (any 2xx): `{"results": [r0, r1, ...]}`, one a sample, in order. Each is a number
  (the reward) or an object

      {"score": float | null, "status": "ok" | "invalid_output" (default "ok"),
       "reason": str (optional), "components": {name: number} (optional)}

  An `ok` result needs a finite score; an `invalid_output` one keeps that status (its score is
  dropped). Components are logged, never trained on (`streamrl.api.reward`).

Failures, per request (a batch); a failed sample is never scored 0:

- Infrastructure errors (connection refused or reset, no reply within `timeout_s`, HTTP 5xx, 429,
  408) are retried up to `max_retries` times, waiting `backoff_s`, then twice that, and so on
  (plus up to 10% jitter, at most `max_backoff_s`). After the last try every sample of the batch
  is `timeout` (when the last try timed out) or `infra_error`, the reason naming the URL, the
  HTTP status or the exception, and the number of attempts.
- Any other 4xx is not retried: `infra_error`, "HTTP 400 from <url>: <start of the body>".
  Redirects are not followed (the token would go with them): a 3xx is treated the same way.
- A 2xx reply that is not JSON, lacks `results`, has the wrong number of them or is larger than
  `MAX_RESULT_BYTES` (plus `RESULT_BYTES_PER_TASK` a sample past the first) is `infra_error` for
  the batch; a result with an ill-typed or non-finite score, or an unknown status, is
  `infra_error` for its sample. Neither is retried.

The token never appears in a reason, an exception or the log, and reasons show the URL without
its user info or query (which may hold credentials).
"""

from __future__ import annotations

import http.client
import json
import logging
import math
import random
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from streamrl.api.reward import RewardResult, RewardStatus
from streamrl.reward.sandbox import MAX_RESULT_BYTES, RESULT_BYTES_PER_TASK, ScoreTask
from streamrl.reward.worker import MAX_COMPONENTS, MAX_NAME_CHARS, MAX_REASON_CHARS

# Statuses a retry may cure: the service (or a proxy before it) is overloaded or restarting.
RETRIED_HTTP_STATUSES = frozenset({408, 429})
BODY_CHARS_IN_REASON = 200
_READ_CHUNK = 1 << 16
_FAILURE_STATUSES: tuple[RewardStatus, ...] = ("invalid_output", "timeout", "infra_error")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RemoteSettings:
    url: str
    """The service's endpoint, `http://` or `https://`."""
    token: str | None = field(default=None, repr=False)
    """Sent as `Authorization: Bearer <token>` when set; never logged (nor in the repr)."""
    timeout_s: float = 10.0
    """Per HTTP request: bounds the connect, each read, and the reading of the whole reply."""
    max_retries: int = 3
    """Retries after the first attempt, for infrastructure errors only."""
    backoff_s: float = 0.5
    """The wait before the first retry; it doubles each retry (plus up to 10% jitter)."""
    max_backoff_s: float = 8.0
    """The longest wait between two attempts."""
    concurrency: int = 4
    """The most HTTP requests in flight at once (over all `score` calls of one RemoteReward)."""
    batch_size: int = 32
    """Samples a request."""

    def __post_init__(self) -> None:
        parts = None
        if isinstance(self.url, str):
            try:
                parts = urllib.parse.urlsplit(self.url)
                _ = parts.port  # raises on a port that is not a number in range
            except ValueError:
                parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(
                f"remote reward url {self.url!r} is not an http:// or https:// URL with a host; "
                "give the service's endpoint, e.g. http://127.0.0.1:8000/score"
            )
        if self.token is not None and (not self.token or any(c in self.token for c in "\r\n")):
            raise ValueError("remote reward token is empty or holds a line break; check its value")
        for name in ("timeout_s", "concurrency", "batch_size"):
            if not getattr(self, name) > 0:
                raise ValueError(f"remote reward {name} is {getattr(self, name)}; it must be > 0")
        for name in ("max_retries", "backoff_s", "max_backoff_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"remote reward {name} is {getattr(self, name)}; it must be >= 0")


@dataclass(frozen=True)
class _Failure:
    """One attempt that got no usable reply."""

    status: RewardStatus
    reason: str
    retryable: bool


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """A 3xx stays an error: following it would send the token (and the samples) elsewhere."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


class RemoteReward:
    """Scores tasks with a remote reward service; see the module docstring for the protocol."""

    def __init__(self, settings: RemoteSettings, *, name: str = "remote"):
        self.settings = settings
        self.name = name
        self._shown_url = _shown_url(settings.url)
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if settings.token is not None:
            self._headers["Authorization"] = f"Bearer {settings.token}"
        self._opener = urllib.request.build_opener(_NoRedirects())
        self._pool = ThreadPoolExecutor(settings.concurrency, thread_name_prefix=f"reward-{name}")
        self._lock = threading.Lock()
        self._counters = {"requests": 0, "retries": 0, "samples": 0}
        self._counters.update({f"failures/{status}": 0 for status in _FAILURE_STATUSES})
        self._closed = False

    def counters(self) -> dict[str, int]:
        """`requests` (HTTP attempts, retries included), `retries`, `samples` scored, and
        `failures/<status>`: samples whose result was `invalid_output`, `timeout` or
        `infra_error`."""
        with self._lock:
            return dict(self._counters)

    def score(self, tasks: Sequence[ScoreTask]) -> list[RewardResult]:
        """One result a task, in order; failures are results (see the module docstring), not
        exceptions. Raises RuntimeError after `close`."""
        if self._closed:
            raise RuntimeError(f"remote reward {self.name!r} is closed; make a new RemoteReward")
        size = self.settings.batch_size
        batches = [tasks[i : i + size] for i in range(0, len(tasks), size)]
        futures = [self._pool.submit(self._score_batch, batch) for batch in batches]
        results = [result for future in futures for result in future.result()]
        assert len(results) == len(tasks)
        with self._lock:
            self._counters["samples"] += len(results)
            for result in results:
                if result.status != "ok":
                    self._counters[f"failures/{result.status}"] += 1
        return results

    def close(self) -> None:
        """Wait for the requests in flight, then stop the threads. Idempotent."""
        self._closed = True
        self._pool.shutdown(wait=True)

    def _score_batch(self, batch: Sequence[ScoreTask]) -> list[RewardResult]:
        try:
            body = json.dumps({"samples": [_sample(task) for task in batch]}, allow_nan=False)
        except (TypeError, ValueError) as err:
            reason = f"cannot send the samples to {self._shown_url} as JSON: {err}"
            return [RewardResult(None, "infra_error", self._scrub(reason))] * len(batch)
        settings = self.settings
        for attempt in range(1, settings.max_retries + 2):
            reply = self._attempt(body.encode(), len(batch))
            if not isinstance(reply, _Failure):
                return reply
            if not reply.retryable:
                return [RewardResult(None, reply.status, self._scrub(reply.reason))] * len(batch)
            if attempt > settings.max_retries:
                break
            wait_s = min(settings.max_backoff_s, settings.backoff_s * 2 ** (attempt - 1))
            wait_s = min(settings.max_backoff_s, wait_s * (1 + 0.1 * random.random()))
            log.warning(
                "%s: %s; retry %d of %d in %.2f s",
                self.name,
                self._scrub(reply.reason),
                attempt,
                settings.max_retries,
                wait_s,
            )
            with self._lock:
                self._counters["retries"] += 1
            time.sleep(wait_s)
        s = "" if attempt == 1 else "s"
        reason = self._scrub(f"{reply.reason}; gave up after {attempt} attempt{s}")
        return [RewardResult(None, reply.status, reason)] * len(batch)

    def _attempt(self, body: bytes, num_samples: int) -> list[RewardResult] | _Failure:
        """One POST: the batch's results, or what went wrong and whether a retry may cure it."""
        with self._lock:
            self._counters["requests"] += 1
        settings, url = self.settings, self._shown_url
        request = urllib.request.Request(settings.url, body, self._headers, method="POST")
        limit = MAX_RESULT_BYTES + RESULT_BYTES_PER_TASK * max(0, num_samples - 1)
        deadline = time.monotonic() + settings.timeout_s
        try:
            with self._opener.open(request, timeout=settings.timeout_s) as reply:
                raw = _read(reply, limit, deadline)
        except urllib.error.HTTPError as err:
            try:
                text = _body_text(err)
            finally:
                err.close()
            reason = f"HTTP {err.code} from {url}: {text}"
            if 300 <= err.code < 400:
                reason += "; redirects are not followed, give the final URL"
            retryable = err.code >= 500 or err.code in RETRIED_HTTP_STATUSES
            return _Failure("infra_error", reason, retryable)
        except urllib.error.URLError as err:
            if isinstance(err.reason, TimeoutError):
                return self._timed_out()
            return _Failure("infra_error", f"cannot reach {url}: {err.reason}", True)
        except TimeoutError:
            return self._timed_out()
        except (OSError, http.client.HTTPException) as err:
            return _Failure("infra_error", f"request to {url} failed: {_describe(err)}", True)
        if raw is None:
            return _Failure("infra_error", f"reply from {url} is over {limit} bytes", False)
        return self._results(raw, num_samples)

    def _timed_out(self) -> _Failure:
        reason = f"no reply from {self._shown_url} within {self.settings.timeout_s} s"
        return _Failure("timeout", reason, True)

    def _results(self, raw: bytes, num_samples: int) -> list[RewardResult] | _Failure:
        url = self._shown_url
        try:
            message = json.loads(raw)
        except (ValueError, RecursionError) as err:
            return _Failure("infra_error", f"reply from {url} is not JSON: {err}", False)
        results = message.get("results") if isinstance(message, dict) else None
        if not isinstance(results, list):
            reason = f'reply from {url} is not an object with a "results" list: {raw[:80]!r}'
            return _Failure("infra_error", reason, False)
        if len(results) != num_samples:
            reason = f"reply from {url} has {len(results)} results for {num_samples} samples"
            return _Failure("infra_error", reason, False)
        return [self._checked(i, item) for i, item in enumerate(results)]

    def _checked(self, index: int, item: Any) -> RewardResult:
        """One result of the reply as a RewardResult, or `infra_error` saying what was wrong."""
        where = f"result {index} from {self._shown_url}"
        if _is_number(item):
            item = {"score": item}
        if not isinstance(item, dict):
            return RewardResult(None, "infra_error", f"{where} is a {type(item).__name__}")
        status, score = item.get("status", "ok"), item.get("score")
        reason = item.get("reason", "")
        reason = self._scrub(reason[:MAX_REASON_CHARS] if isinstance(reason, str) else "")
        if status not in ("ok", "invalid_output"):
            shown = str(status)[:40]
            bad = f"{where} has the status {shown!r}; expected 'ok' or 'invalid_output'"
            return RewardResult(None, "infra_error", bad)
        parts = item.get("components", {})
        if not isinstance(parts, dict) or len(parts) > MAX_COMPONENTS:
            bad = f"{where} has components that are not an object of at most {MAX_COMPONENTS}"
            return RewardResult(None, "infra_error", bad)
        components = {}
        for name, part in parts.items():
            if not _is_finite(part):
                bad = f"{where} has the component {str(name)[:MAX_NAME_CHARS]!r} = {part!r:.40}"
                return RewardResult(None, "infra_error", f"{bad}, not a finite number")
            components[str(name)[:MAX_NAME_CHARS]] = float(part)
        if status == "invalid_output":
            return RewardResult(None, "invalid_output", reason, components)
        if not _is_finite(score):
            bad = f"{where} has the score {score!r:.40}, not a finite number, with status ok"
            return RewardResult(None, "infra_error", bad)
        return RewardResult(float(score), "ok", reason, components)

    def _scrub(self, text: str) -> str:
        """`text` without the token, should a service or a library have echoed it."""
        token = self.settings.token
        return text.replace(token, "<token>") if token else text


def _sample(task: ScoreTask) -> dict[str, Any]:
    return {
        "prompt": task.prompt,
        "response": task.response,
        "answer": task.answer,
        "extra": task.extra,
    }


def _read(reply: http.client.HTTPResponse, limit: int, deadline: float) -> bytes | None:
    """The reply's body, or None past `limit` bytes; TimeoutError past `deadline` (a server that
    sends a byte now and then keeps each read under the socket timeout)."""
    chunks, size = [], 0
    while chunk := reply.read(_READ_CHUNK):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            return None
        if time.monotonic() > deadline:
            raise TimeoutError("the reply took longer than timeout_s to read")
    return b"".join(chunks)


def _body_text(err: urllib.error.HTTPError) -> str:
    """The start of an error reply's body, for the reason."""
    try:
        text = err.read(BODY_CHARS_IN_REASON * 4).decode("utf-8", errors="replace")
    except (OSError, http.client.HTTPException) as read_err:
        return f"(body unreadable: {_describe(read_err)})"
    return " ".join(text.split())[:BODY_CHARS_IN_REASON] or "(empty body)"


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _shown_url(url: str) -> str:
    """The URL for reasons and logs: scheme, host, port and path, no user info or query."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{host}{port}{parts.path}"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite(value: Any) -> bool:
    """A number that is a finite float (an int too large for a float is not)."""
    try:
        return _is_number(value) and math.isfinite(float(value))
    except OverflowError:
        return False
