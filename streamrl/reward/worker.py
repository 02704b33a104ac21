"""The reward sandbox's worker process: scores the tasks that arrive on a private channel.

Run by `streamrl.reward.sandbox.SandboxedScorer`, inside its sandbox, as

    python -P -m streamrl.reward.worker SPEC --channel FD [--cpu-per-call S]
        [--end-leftovers HOST_PID_NAMESPACE]

SPEC is JSON: `{"functions": [{"path", "style", "weight", "name"}, ...], "conversational"}`
(`streamrl.reward.forms`). The channel is a socket the scorer passes as file descriptor FD. Both
ways it carries frames: a 4-byte big-endian length, then that many bytes of JSON. The worker
sends `{"ready": pid}` once the reward's modules are imported (or `{"error": ...}` and exits),
then answers each batch `{"id", "tasks": [{"response", "answer", "extra", "prompt",
"completion_ids"}, ...]}` with `{"id", "results": [{"value", "status", "reason", "components"},
...]}`, one result a task, in order. Each function is called in its form: a TRL-style one once
for the batch, an async one awaited concurrently over it, any other once a task; each call gets
`--cpu-per-call` CPU seconds. stdout and stderr are the reward functions' own: the scorer logs
them, never reads results from them. The worker exits at the end of input.

What leaves here is already cut to size (a reason of at most `MAX_REASON_CHARS`, at most
`MAX_COMPONENTS` components), but the scorer checks every result again: this process runs
untrusted code. With `--end-leftovers`, and only inside a PID namespace of its own, every process
that a batch's calls started and left running is killed once the batch is scored.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import resource
import signal
import socket
import struct
from typing import Any

from streamrl.api.reward import RewardResult
from streamrl.reward.forms import RewardFunction, Runner, score_batch
from streamrl.reward.scoring import resolve_callable

HEADER = struct.Struct(">I")
MAX_REASON_CHARS = 1000
MAX_COMPONENTS = 64
MAX_NAME_CHARS = 100


def encode(message: dict[str, Any]) -> bytes:
    body = json.dumps(message).encode()
    return HEADER.pack(len(body)) + body


def payload(result: RewardResult) -> dict[str, Any]:
    """A result as the JSON the scorer reads, cut to size. Values are sent as they are (a NaN
    too) for the scorer to judge; anything that is not a number is sent as its type's name."""
    value = result.value
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
        value = f"<{type(value).__name__}>"
    reason = result.reason if isinstance(result.reason, str) else repr(result.reason)
    if len(reason) > MAX_REASON_CHARS:
        reason = f"{reason[:MAX_REASON_CHARS]}... ({len(reason)} characters)"
    components = {}
    for name, part in itertools.islice(dict(result.components).items(), MAX_COMPONENTS):
        if isinstance(part, (int, float)):
            components[str(name)[:MAX_NAME_CHARS]] = float(part)
    status = result.status if isinstance(result.status, str) else repr(result.status)
    return {"value": value, "status": status[:MAX_NAME_CHARS], "reason": reason} | {
        "components": components
    }


class CpuLimitExceeded(Exception):
    """Raised inside the reward function when its call passes its CPU seconds (SIGXCPU)."""


def _set_cpu_budget(seconds: float) -> None:
    """Let this call use `seconds` more CPU seconds (the soft RLIMIT_CPU; SIGXCPU past it)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    soft = math.ceil(usage.ru_utime + usage.ru_stime + seconds)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard < 0 else min(soft, hard), hard))


def _processes() -> set[int]:
    return {int(name) for name in os.listdir("/proc") if name.isdigit()}


def _end_leftovers(spared: set[int]) -> None:
    """SIGKILL every process of the sandbox a call left running (it cannot reach outside its
    PID namespace), except those alive when the reward's module was imported (a helper it
    started on purpose), then reap this process's own children."""
    if spared:
        for pid in _processes() - spared:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # gone already, or the namespace's init (root's): not a leftover
    else:
        try:
            os.kill(-1, signal.SIGKILL)  # all but this process and the namespace's init
        except ProcessLookupError:
            pass  # nothing left: the usual case
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _receive(channel: socket.socket) -> dict[str, Any] | None:
    header = _read_exactly(channel, HEADER.size)
    if header is None:
        return None
    body = _read_exactly(channel, HEADER.unpack(header)[0])
    return None if body is None else json.loads(body)


def _read_exactly(channel: socket.socket, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        chunk = channel.recv(min(size - len(data), 1 << 20))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def load_functions(spec: dict[str, Any]) -> list[RewardFunction]:
    """The reward functions SPEC names, imported, in the forms the scorer found."""
    return [
        RewardFunction(resolve_callable(f["path"]), f["style"], f["name"], float(f["weight"]))
        for f in spec["functions"]
    ]


def _score(functions, tasks, runner, before_call, conversational) -> list[dict[str, Any]]:
    try:
        results = score_batch(
            functions, tasks, runner=runner, before_call=before_call, conversational=conversational
        )
    except Exception as e:  # reported to the scorer as infra_error, never swallowed
        message = f"{type(e).__name__}: {e}"
        results = [RewardResult(None, "infra_error", message[: MAX_REASON_CHARS + 1])] * len(tasks)
    return [payload(r) for r in results]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="streamrl.reward.worker")
    parser.add_argument("spec")
    parser.add_argument("--channel", type=int, required=True)
    parser.add_argument("--cpu-per-call", type=float)
    parser.add_argument("--end-leftovers", metavar="HOST_PID_NAMESPACE")
    args = parser.parse_args(argv)
    channel = socket.socket(fileno=args.channel)
    try:
        spec = json.loads(args.spec)
        functions = load_functions(spec)
    except Exception as e:  # the scorer raises it to the caller
        channel.sendall(encode({"error": f"{type(e).__name__}: {e}"[:4000]}))
        return 1
    if args.cpu_per_call:

        def over_cpu(signum: int, frame: object) -> None:
            raise CpuLimitExceeded(f"the call used over {args.cpu_per_call:g} CPU seconds")

        signal.signal(signal.SIGXCPU, over_cpu)
    # Only inside a PID namespace of its own may the worker end "every other process".
    own_namespace = (
        args.end_leftovers is not None and os.readlink("/proc/self/ns/pid") != args.end_leftovers
    )
    spared = _processes() - {os.getpid(), 1} if own_namespace else set()
    channel.sendall(encode({"ready": os.getpid()}))
    runner = Runner()

    def before_call() -> None:
        if args.cpu_per_call:
            _set_cpu_budget(args.cpu_per_call)

    conversational = bool(spec.get("conversational"))
    while (batch := _receive(channel)) is not None:
        results = _score(functions, batch["tasks"], runner, before_call, conversational)
        channel.sendall(encode({"id": batch["id"], "results": results}))
        if own_namespace:
            _end_leftovers(spared)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
