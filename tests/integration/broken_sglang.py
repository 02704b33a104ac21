"""A stand-in for an SGLang server that starts, says it is healthy and serves a generative model,
then fails every generation, as a server out of memory does: for tests of a role whose loop keeps
failing after it was built. Launched as `python broken_sglang.py --model-path M --port P ...`."""

from __future__ import annotations

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    def _answer(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path in ("/model_info", "/get_model_info"):
            self._answer(200, {"is_generation": True})
        else:
            self._answer(200, {})

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/generate":
            self._answer(500, {"error": {"message": "CUDA out of memory (simulated)"}})
        else:
            self._answer(200, {"success": True, "message": ""})

    def log_message(self, *args) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    args, _ = parser.parse_known_args()
    ThreadingHTTPServer(("127.0.0.1", args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
