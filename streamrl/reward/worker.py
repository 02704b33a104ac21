"""The reward sandbox's worker process: reads tasks as JSON lines, writes results as JSON lines.

Run as `python -m streamrl.reward.worker MODULE:FUNCTION MEMORY_LIMIT_BYTES` by
`streamrl.reward.sandbox.SandboxedScorer`; exits at end of input.
"""

from __future__ import annotations

import json
import resource
import sys

from streamrl.api.reward import RewardResult
from streamrl.reward.scoring import resolve_callable, to_result


def main() -> None:
    fn_path, memory_limit = sys.argv[1], int(sys.argv[2])
    if memory_limit > 0:
        resource.setrlimit(resource.RLIMIT_AS, (memory_limit, memory_limit))
    fn = resolve_callable(fn_path)
    out = sys.stdout.buffer
    out.write(b"ready\n")
    out.flush()
    for line in sys.stdin.buffer:
        task = json.loads(line)
        try:
            result = to_result(fn(task["response"], task["answer"], **task["extra"]))
        except Exception as e:  # reported to the parent as infra_error, never swallowed
            result = RewardResult(None, "infra_error", f"{type(e).__name__}: {e}"[:200])
        line = [result.value, result.status, result.reason, dict(result.components)]
        out.write(json.dumps(line).encode() + b"\n")
        out.flush()


if __name__ == "__main__":
    main()
