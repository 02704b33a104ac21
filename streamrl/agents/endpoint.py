"""An OpenAI-compatible chat endpoint over agent episodes: how an unmodified agent program that
talks to `openai.OpenAI()` is trained.

Each episode of such a program (`agents/program.py`) opens a *session* here, named by a fresh
random key that the program uses as its API key. A chat request of a session is one assistant
turn of that episode: the request's messages are matched against what the session has seen,
the new ones are appended to the episode's token ledger as context (mask 0), and the turn is
sampled by the run's scheduler like any other episode's turn (mask 1), so requests of many
programs share engine batches and wait through weight syncs instead of failing.

    program ──POST /v1/chat/completions──► server thread ──(session's loop)──► Session.complete
       ▲                                    (auth, checks)                       │ add_messages /
       └──────── chat.completion (JSON or SSE) ◄─────────────────────────────────┘ restart, turn()

The server runs on its own thread and event loop, one per process for a (host, port), and
outlives the event loops of `AgentRunner.run` (one per batch of episodes); a session's work runs
on the loop of its episode. Routes: `POST /v1/chat/completions` (`stream` as server-sent
events), `GET /v1/models`, and `POST /v1/reward` (`{"reward": x}` sets the episode's reward).

How a request continues the ledger (never re-tokenising a sampled token):

1. the session's messages (the program's plus the assistant messages returned, as returned,
   compared by content and parsed tool calls) are a prefix of the request's and the rest are
   not assistant messages: the rest is appended with `client.add_messages`;
2. else the whole request is rendered and tokenised; ids that extend the ledger's tokens append
   the difference (the first request of an episode whose prompt is the task's appends nothing);
3. else the program rewrote its history: the ledger restarts on the rendered request, a new
   training sample (`ledger.num_splits`).

Sampling is the run's: a request asking for another temperature, top_p, stop strings, several
choices, log-probs or a response format is refused with a 400 that says so; `max_tokens` above
the run's per-turn cap is capped, a smaller one cuts the turn. An episode past its turn limit or
token budget answers with finish_reason "length" and empty content.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import threading
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from streamrl.agents.episode import EpisodeClient, EpisodeLimit
from streamrl.api.engine import SamplingParams
from streamrl.weights.tcp import is_loopback

log = logging.getLogger(__name__)

MODEL_NAME = "streamrl-policy"
"""The model the endpoint serves (`GET /v1/models`); a request may name any model."""

# Parameters that do not change what is sampled: accepted and ignored. (`seed`: a turn's noise
# is seeded by the run, per request id.)
IGNORED = frozenset(
    "model user seed stream_options parallel_tool_calls metadata store service_tier "
    "prompt_cache_key safety_identifier".split()
)
# Parameters that are read (and refused where they would sample differently from the run).
_KNOWN = frozenset(
    "messages tools tool_choice stream max_tokens max_completion_tokens n logprobs top_logprobs "
    "response_format temperature top_p top_k min_p stop presence_penalty frequency_penalty "
    "repetition_penalty logit_bias functions function_call".split()
)
_ROLES = {"developer": "system", **{role: role for role in ("system", "user", "assistant", "tool")}}


class RequestError(Exception):
    """A request the endpoint refuses: an OpenAI error object with an HTTP status."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400):
        super().__init__(message)
        self.param = param
        self.status = status

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": None}}


@dataclass(frozen=True)
class ChatRequest:
    """A checked chat request: the messages in the chat formats' shape, and what to return."""

    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str
    stream: bool
    include_usage: bool
    max_tokens: int


def parse_chat_request(body: Any, params: SamplingParams) -> ChatRequest:
    """Check a `/v1/chat/completions` body against what the run samples (`params`). Raises
    `RequestError` for anything the endpoint cannot honour (see the module docstring)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    unknown = sorted(set(body) - _KNOWN - IGNORED)
    if unknown:
        raise RequestError(f"unsupported parameter(s) {', '.join(unknown)}", unknown[0])
    _refuse_other_sampling(body, params)
    if body.get("functions") is not None or body.get("function_call") is not None:
        param = "functions" if body.get("functions") is not None else "function_call"
        raise RequestError(
            "the legacy `functions`/`function_call` parameters are not supported; pass `tools`",
            param,
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("`messages` must be a non-empty list of chat messages", "messages")
    messages = [_message(i, m) for i, m in enumerate(messages)]
    if messages[-1]["role"] == "assistant":
        raise RequestError(
            "the last message is an assistant message; continuing a written assistant turn is "
            "not supported: end with a user or tool message",
            "messages",
        )
    tools = body.get("tools")
    if tools is not None and (
        not isinstance(tools, list) or not all(_is_function_tool(t) for t in tools)
    ):
        raise RequestError(
            '`tools` must be a list of {"type": "function", "function": {"name": ...}}', "tools"
        )
    tool_choice = body.get("tool_choice") or "auto"
    if tool_choice not in ("auto", "none"):
        raise RequestError(
            f"tool_choice={tool_choice!r} is not supported: the model decides whether to call a "
            "tool (`auto`), or its calls are returned as text (`none`)",
            "tool_choice",
        )
    if not isinstance(body.get("stream", False), bool):
        raise RequestError("`stream` must be true or false", "stream")
    options = body.get("stream_options") or {}
    return ChatRequest(
        messages=messages,
        tools=tools or None,
        tool_choice=tool_choice,
        stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        max_tokens=_max_tokens(body, params),
    )


def _refuse_other_sampling(body: Mapping[str, Any], params: SamplingParams) -> None:
    """400 for a parameter that would sample differently from the run (the trained log-probs
    are those of the run's sampling distribution, so a program cannot choose its own)."""
    if body.get("n") not in (None, 1):
        raise RequestError("n must be 1: each request samples one turn of one episode", "n")
    if body.get("logprobs") or body.get("top_logprobs") is not None:
        param = "logprobs" if body.get("logprobs") else "top_logprobs"
        raise RequestError("log-probs are not returned by this endpoint", param)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise RequestError(
            "response_format is not supported: the model's output is not constrained",
            "response_format",
        )
    if body.get("stop"):
        raise RequestError(
            "stop is not supported: a turn ends at the model's end-of-turn token", "stop"
        )
    run = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,
        "min_p": params.min_p,
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
    for name, value in run.items():
        asked = body.get(name)
        if asked is None:
            continue
        if not isinstance(asked, int | float) or isinstance(asked, bool):
            raise RequestError(f"{name} must be a number, got {asked!r}", name)
        if not math.isclose(float(asked), float(value), abs_tol=1e-9):
            raise RequestError(
                f"{name}={asked} differs from the run's {name}={value}: turns are sampled with "
                "the run's settings (rollout.*), which the trained log-probs belong to; leave "
                f"{name} out of the request",
                name,
            )
    if body.get("logit_bias"):
        raise RequestError("logit_bias is not supported: sampling is the run's", "logit_bias")


def _max_tokens(body: Mapping[str, Any], params: SamplingParams) -> int:
    cap = params.max_new_tokens
    for name in ("max_tokens", "max_completion_tokens"):
        value = body.get(name)
        if value is None:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise RequestError(f"{name} must be a positive integer, got {value!r}", name)
        cap = min(cap, value)  # above the run's per-turn cap: capped
    return cap


def _is_function_tool(tool: Any) -> bool:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        return False
    function = tool.get("function")
    return isinstance(function, dict) and isinstance(function.get("name"), str)


def _message(index: int, message: Any) -> dict[str, Any]:
    """One request message in the chat formats' shape (text content, known keys only)."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object", where)
    role = message.get("role")
    role = _ROLES.get(role) if isinstance(role, str) else None
    if role is None:
        raise RequestError(
            f"{where} has role {message.get('role')!r}; expected system, developer, user, "
            "assistant or tool",
            f"{where}.role",
        )
    content = message.get("content")
    if isinstance(content, list):  # content parts: text only
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) != len(content) or not all(isinstance(t, str) for t in texts):
            raise RequestError(
                f"{where}: only text content parts are supported", f"{where}.content"
            )
        content = "".join(texts)
    elif content is not None and not isinstance(content, str):
        raise RequestError(f"{where}: content must be a string", f"{where}.content")
    out: dict[str, Any] = {"role": role, "content": content}
    for key in ("tool_calls", "tool_call_id", "name"):
        if message.get(key) is not None:
            out[key] = message[key]
    if out.get("tool_calls") is not None and not isinstance(out["tool_calls"], list):
        raise RequestError(f"{where}: tool_calls must be a list", f"{where}.tool_calls")
    return out


def _key(message: Mapping[str, Any]) -> tuple:
    """What identifies a message when a client echoes it back: its role, its text, its tool
    calls' names and arguments (as parsed JSON: the client may re-serialise them)."""
    calls = []
    for call in message.get("tool_calls") or ():
        function = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(function, dict):
            function = {"name": repr(call)}  # malformed: equal only to itself (render refuses it)
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                pass  # compared as the text it is
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return (
        message.get("role"),
        message.get("content") or "",
        tuple(calls),
        message.get("tool_call_id") or "",
    )


def _continues(known: Sequence[Mapping[str, Any]], messages: Sequence[Mapping[str, Any]]) -> bool:
    """Whether `messages` are `known` followed by messages that are not the assistant's."""
    if not known or len(messages) < len(known):
        return False
    if any(_key(a) != _key(b) for a, b in zip(known, messages, strict=False)):
        return False
    return all(m["role"] != "assistant" for m in messages[len(known) :])


@dataclass
class Reply:
    """One answered chat request."""

    message: dict[str, Any]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


@dataclass
class Session:
    """One episode as the endpoint sees it: its client (ledger), the conversation so far, and
    the reward the program posted. Its methods run on the episode's event loop (`loop`)."""

    key: str
    client: EpisodeClient
    tokenizer: Any
    params: SamplingParams
    max_turns: int
    loop: asyncio.AbstractEventLoop
    messages: list[dict[str, Any]] = field(default_factory=list)
    reward: float | None = None
    final_text: str = ""
    """The content of the last sampled turn returned to the program."""
    num_requests: int = 0
    exhausted: bool = False
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    _running: set[asyncio.Task] = field(default_factory=set)

    async def complete(self, request: ChatRequest) -> Reply:
        """Sample the next turn for `request` (one at a time per session)."""
        task = asyncio.current_task()
        assert task is not None
        self._running.add(task)
        try:
            async with self._lock:
                self.num_requests += 1
                return await self._complete(request)
        finally:
            self._running.discard(task)

    async def _complete(self, request: ChatRequest) -> Reply:
        ledger = self.client.ledger
        try:
            if self.exhausted or self.client.num_turns >= self.max_turns:
                raise EpisodeLimit
            self._follow(request)
            prompt_tokens = len(ledger.all_ids())
            turn = await self._turn(request.max_tokens)
        except EpisodeLimit:
            self.exhausted = True
            message = {"role": "assistant", "content": ""}
            return Reply(message, "length", len(ledger.all_ids()), 0)
        if request.tool_choice == "none":  # calls stay in the text
            text = turn.text.rstrip().removesuffix(self.client.chat.end_of_turn)
            message = {"role": "assistant", "content": text.strip()}
        else:
            message = self.client.chat.assistant_message(turn.text, request.tools)
        self.messages.append(message)
        self.final_text = message.get("content") or ""
        finish = turn.finish_reason
        if finish != "length":
            finish = "tool_calls" if message.get("tool_calls") else "stop"
        return Reply(message, finish, prompt_tokens, len(ledger.all_ids()) - prompt_tokens)

    def _follow(self, request: ChatRequest) -> None:
        """Bring the ledger up to the request's messages (the module docstring's three cases)."""
        messages, ledger = request.messages, self.client.ledger
        if _continues(self.messages, messages):
            rest = messages[len(self.messages) :]
            if rest:
                self._check(lambda: self.client.add_messages(rest))
            self.messages = [*self.messages, *rest]
            return
        text = self._check(
            lambda: self.client.chat.render(messages, request.tools, add_generation_prompt=True)
        )
        ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        if ledger.extends(ids):
            extra = ids[len(ledger.all_ids()) :]
            if extra and len(extra) >= self.client.tokens_left:
                raise EpisodeLimit
            ledger.add_context(extra)
        else:
            if not self.messages:
                _warn_first_prompt(text, self.tokenizer.decode(ledger.all_ids()))
            log.debug("session %s: the history was rewritten; a new sample starts", self.key[:6])
            ledger.restart(ids)
        self.messages = list(messages)

    @staticmethod
    def _check(render):
        """`render()`, with the chat format's complaints about the messages as a 400."""
        try:
            return render()
        except (ValueError, TypeError) as error:
            raise RequestError(f"the messages cannot be rendered: {error}", "messages") from None

    async def _turn(self, max_tokens: int):
        """One turn of at most `max_tokens` tokens: a smaller cap than the run's cuts the
        sampled turn (its first `max_tokens` tokens are kept, finish reason length)."""
        client = self.client
        budget = client.max_total_tokens
        client.max_total_tokens = min(budget, client.ledger.num_response_tokens + max_tokens)
        try:
            return await client.turn()
        finally:
            client.max_total_tokens = budget

    def cancel(self) -> None:
        """Stop the requests still running (the episode ended under them)."""
        for task in list(self._running):
            task.cancel()


_warned_first_prompt = False


def _warn_first_prompt(rendered: str, task_prompt: str) -> None:
    """Once per process: programs whose first request is not the task's prompt split every
    episode (a system message of their own, say, or tools a chat format renders)."""
    global _warned_first_prompt
    if not _warned_first_prompt:
        _warned_first_prompt = True
        log.warning(
            "an agent program's first request renders differently from its task's prompt, so "
            "its episode restarts as a new sample (counted in splits)."
            "\n  request: %r\n  task:    %r",
            rendered[:300],
            task_prompt[:300],
        )


def completion(reply: Reply) -> dict[str, Any]:
    """A `chat.completion` object."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": MODEL_NAME,
        "choices": [
            {
                "index": 0,
                "message": reply.message,
                "finish_reason": reply.finish_reason,
                "logprobs": None,
            }
        ],
        "usage": _usage(reply),
    }


def completion_chunks(reply: Reply, *, include_usage: bool) -> list[dict[str, Any]]:
    """The whole turn as `chat.completion.chunk` objects: the content, one delta per tool
    call, the finish reason, and the usage when asked for (`stream_options.include_usage`)."""
    head = {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": MODEL_NAME,
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {**head, "choices": [choice]}

    message = reply.message
    chunks = [chunk({"role": "assistant", "content": message.get("content")})]
    for i, call in enumerate(message.get("tool_calls") or ()):
        chunks.append(chunk({"tool_calls": [{"index": i, **call}]}))
    chunks.append(chunk({}, reply.finish_reason))
    if include_usage:
        chunks.append({**head, "choices": [], "usage": _usage(reply)})
    return chunks


def _usage(reply: Reply) -> dict[str, int]:
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": reply.completion_tokens,
        "total_tokens": reply.prompt_tokens + reply.completion_tokens,
    }


def _error(status: int, message: str, param: str | None = None) -> web.Response:
    return web.json_response(RequestError(message, param, status=status).body(), status=status)


class EndpointServer:
    """The HTTP server and its sessions (see the module docstring). `open` and `close` are
    called by a workflow on its episode's event loop; the routes run on the server's thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0):
        self.host = host
        self.port = port
        self._sessions: dict[str, Session] = {}
        self._guard = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="streamrl-endpoint", daemon=True
        )
        self._runner: web.AppRunner | None = None

    def start(self) -> EndpointServer:
        """Bind and serve; `port` 0 takes any free port (read `port` afterwards)."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=60)
        log.info("OpenAI-compatible endpoint at %s", self.base_url)
        return self

    async def _start(self) -> None:
        app = web.Application(client_max_size=64 * 2**20)
        app.add_routes(
            [
                web.post("/v1/chat/completions", self._chat),
                web.get("/v1/models", self._models),
                web.post("/v1/reward", self._reward),
            ]
        )
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])

    def stop(self) -> None:
        """Stop serving and end the server's thread."""
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)

    @property
    def base_url(self) -> str:
        """The URL a program on this machine reaches the endpoint at (an `OPENAI_BASE_URL`)."""
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}/v1"

    def open(
        self, client: EpisodeClient, tokenizer, *, params: SamplingParams, max_turns: int
    ) -> Session:
        """A new session over `client`'s episode, with a fresh random key (its API key). Call on
        the episode's event loop, which runs the session's turns."""
        session = Session(
            secrets.token_urlsafe(32),
            client,
            tokenizer,
            params,
            max_turns,
            asyncio.get_running_loop(),
        )
        with self._guard:
            self._sessions[session.key] = session
        return session

    def close(self, session: Session) -> None:
        """End a session: its key stops working and its running requests are cancelled."""
        with self._guard:
            self._sessions.pop(session.key, None)
        session.cancel()

    # --- routes (on the server's thread) ----------------------------------------------------

    def _session_of(self, request: web.Request) -> Session | None:
        scheme, _, key = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key:
            return None
        with self._guard:
            return self._sessions.get(key.strip())

    @staticmethod
    def _unauthorised() -> web.Response:
        return web.json_response(
            {
                "error": {
                    "message": "unknown or expired API key: each episode's program gets its "
                    "own key in OPENAI_API_KEY, valid while the episode runs",
                    "type": "invalid_request_error",
                    "param": None,
                    "code": "invalid_api_key",
                }
            },
            status=401,
        )

    async def _models(self, request: web.Request) -> web.Response:
        if not is_loopback(self.host) and self._session_of(request) is None:
            return self._unauthorised()
        model = {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "streamrl"}
        return web.json_response({"object": "list", "data": [model]})

    async def _reward(self, request: web.Request) -> web.Response:
        session = self._session_of(request)
        if session is None:
            return self._unauthorised()
        try:
            body = await _json(request)
        except RequestError as error:
            return web.json_response(error.body(), status=error.status)
        reward = body.get("reward") if isinstance(body, dict) else None
        if isinstance(reward, bool) or not isinstance(reward, int | float):
            return _error(400, 'the body must be {"reward": <number>}', "reward")
        if not math.isfinite(reward):
            return _error(400, f"the reward must be finite, got {reward}", "reward")
        session.reward = float(reward)
        return web.json_response({"reward": session.reward})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        session = self._session_of(request)
        if session is None:
            return self._unauthorised()
        try:
            chat = parse_chat_request(await _json(request), session.params)
            done = asyncio.run_coroutine_threadsafe(session.complete(chat), session.loop)
        except RequestError as error:
            return web.json_response(error.body(), status=error.status)
        except RuntimeError:  # the episode's loop is closed: it ended
            return self._unauthorised()
        try:
            reply = await asyncio.wrap_future(done)
        except RequestError as error:
            return web.json_response(error.body(), status=error.status)
        except asyncio.CancelledError:
            if not done.cancelled():
                raise
            return self._unauthorised()  # the episode ended while the turn was sampled
        except Exception as error:  # noqa: BLE001 - the program gets a 500, the log the trace
            log.exception("chat request of session %s failed", session.key[:6])
            return _error(500, f"the turn could not be sampled: {type(error).__name__}: {error}")
        if not chat.stream:
            return web.json_response(completion(reply))
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        for chunk in completion_chunks(reply, include_usage=chat.include_usage):
            await response.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


async def _json(request: web.Request) -> Any:
    try:
        return await request.json()
    except ValueError as error:
        raise RequestError(f"the request body is not JSON: {error}") from None


_servers: dict[tuple[str, int], EndpointServer] = {}
_servers_guard = threading.Lock()


def shared_endpoint(host: str = "127.0.0.1", port: int = 0) -> EndpointServer:
    """This process's server for (host, port), started at the first call."""
    with _servers_guard:
        server = _servers.get((host, port))
        if server is None:
            server = _servers[(host, port)] = EndpointServer(host, port).start()
        return server
