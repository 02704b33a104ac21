"""The forms a reward function is written in, recognised by its signature and called as written.

- streamrl: `fn(response, answer, **extra)`, called once a sample; returns a float, a
  `RewardResult` or a mapping with `score`.
- trl: `fn(completions, **kwargs)` (TRL's GRPOTrainer), called once a batch; returns a list,
  one float or None a completion.
- verl: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`, called once
  a sample; returns a float or a mapping with `score`.

`detect_style` tells them apart by parameter names: one named `solution_str` is veRL's, one
named `completions` TRL's, and any function that takes two positional arguments is streamrl's
own. `reward.style` names the form when the names do not tell it.

- **TRL**: keyword arguments as GRPOTrainer passes them: `prompts`, `completions`,
  `completion_ids`, `trainer_state` (None here: the trainer's state is in another process) and
  every other column of the dataset as a list with one entry a sample (the reference answer as
  `answer`). Completions are texts, or with `reward.conversational` one assistant message each
  (`[{"role": "assistant", "content": ...}]`), TRL's conversational format. It returns one
  value a completion, `None` where it does not apply.
- **veRL**: `data_source` (the row's `data_source`, "" when it has none), `solution_str` (the
  response), `ground_truth` (the answer) and `extra_info` (the row's `extra_info`, else its
  other keys), each only when the function takes it. A mapping's `score` is the reward, its other
  numbers components.
- `async def` functions of any form are awaited on one event loop of the worker; a batch's calls
  of a per-sample async function run concurrently.

Several functions are combined as TRL combines them: the weighted sum of the values that apply
(`None`: not applicable), each function's value logged as a component under its name. A sample
to which no function applies, or for which one failed, is not scored (`infra_error`, dropped and
counted: TRL would score it 0), and `invalid_output` from any function makes the sample's.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from streamrl.api.reward import RewardResult
from streamrl.reward.scoring import resolve_callable, to_result

Style = Literal["streamrl", "trl", "verl"]
STYLES: tuple[str, ...] = ("auto", "streamrl", "trl", "verl")
ACCEPTED = (
    "streamrl's f(response_text, answer, **extra) (two positional parameters); TRL's batched "
    "f(completions, **kwargs) returning a list (a parameter named 'completions'); veRL's "
    "compute_score(data_source, solution_str, ground_truth, extra_info=None) (a parameter "
    "named 'solution_str')"
)
NOT_APPLICABLE = "no reward function applies to this sample (each returned None)"


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or C callable: nothing to read
        return None


def _takes_keyword(signature: inspect.Signature, name: str) -> bool:
    params = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return True
    param = signature.parameters.get(name)
    return param is not None and param.kind not in (
        inspect.Parameter.POSITIONAL_ONLY,
        inspect.Parameter.VAR_POSITIONAL,
    )


def _takes_two_positional(signature: inspect.Signature) -> bool:
    try:
        signature.bind_partial("response", "answer")
    except TypeError:
        return False
    return True


def detect_style(fn: Callable[..., Any], path: str, style: str = "auto") -> Style:
    """The form `fn` is written in (`style` when not auto, after checking that `fn` can be
    called that way); ValueError naming its signature when it matches none."""
    if style not in STYLES:
        raise ValueError(f"unknown reward style {style!r}; one of {', '.join(STYLES)}")
    signature = _signature(fn)
    if signature is None:  # nothing to read: called as the form says (auto: streamrl's)
        return "streamrl" if style == "auto" else style  # type: ignore[return-value]
    names = [p.name for p in signature.parameters.values()]
    if style == "auto":
        if "solution_str" in names:
            return "verl"
        if "completions" in names:
            return "trl"
        if _takes_two_positional(signature):
            return "streamrl"
        raise ValueError(
            f"{path!r} is called as f(response_text, answer, **extra) unless its parameter "
            f"names say another form, but its signature {signature} (parameters: "
            f"{', '.join(names) or 'none'}) matches none of the accepted forms: {ACCEPTED}. "
            "Set reward.style=streamrl, trl or verl to name its form"
        )
    needs = {
        "streamrl": ("two positional parameters", _takes_two_positional(signature)),
        "trl": ("a 'completions' keyword", _takes_keyword(signature, "completions")),
        "verl": (
            "'solution_str' and 'ground_truth' keywords",
            _takes_keyword(signature, "solution_str") and _takes_keyword(signature, "ground_truth"),
        ),
    }
    what, ok = needs[style]
    if not ok:
        raise ValueError(
            f"{path!r} is set as a {style} reward (reward.style), which needs {what}, but its "
            f"signature is {signature}"
        )
    return style  # type: ignore[return-value]


def check_reward_signature(fn: Callable[..., Any], path: str, style: str = "auto") -> str:
    """The form `fn` is called in (`streamrl.reward.forms`: streamrl, trl or verl); ValueError
    naming its signature when it can be called in none (each call would fail, and every sample
    be dropped)."""
    return detect_style(fn, path, style)


def check_reward_config(cfg: Any) -> list[str]:
    """The form of each function of a `reward` config section, checked as the run will call it;
    ValueError saying which function is wrong and why."""
    return [check_reward_signature(resolve_callable(p), p, cfg.style) for p in cfg.functions]


def is_async(fn: Callable[..., Any]) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 (an object with an async __call__)
    )


@dataclass(frozen=True)
class RewardFunction:
    """One reward function of a run, its form and its weight."""

    fn: Callable[..., Any]
    style: Style
    name: str
    weight: float = 1.0

    @property
    def batched(self) -> bool:
        """Called once for a whole batch (TRL's form, or awaited concurrently over it)."""
        return self.style == "trl" or is_async(self.fn)

    def keywords(self, offered: Mapping[str, Any]) -> dict[str, Any]:
        """The keyword arguments of `offered` that the function takes (all, with **kwargs)."""
        signature = _signature(self.fn)
        if signature is None or any(
            p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values()
        ):
            return dict(offered)
        return {k: v for k, v in offered.items() if _takes_keyword(signature, k)}


def names_of(paths: Sequence[str]) -> list[str]:
    """A component name for each function: its attribute name, numbered when one repeats."""
    names: list[str] = []
    for path in paths:
        base = path.partition(":")[2] if ":" in path else path.rpartition(".")[2]
        name, n = base, 1
        while name in names:
            n += 1
            name = f"{base}_{n}"
        names.append(name)
    return names


class Runner:
    """Runs coroutines to completion on one event loop, replaced after one is interrupted."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None

    def run(self, awaitable: Any) -> Any:
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        try:
            return self._loop.run_until_complete(_awaited(awaitable))
        except BaseException:
            self._loop.close()  # its state is unknown (a CPU-limit signal may land anywhere)
            self._loop = None
            raise


async def _awaited(awaitable: Any) -> Any:
    return await awaitable


async def _gathered(awaitables: list[Any]) -> list[Any]:
    """Each awaitable's result or exception, awaited concurrently (on the running loop)."""
    return await asyncio.gather(*awaitables, return_exceptions=True)


def _error(e: BaseException) -> RewardResult:
    return RewardResult(None, "infra_error", f"{type(e).__name__}: {e}"[:1001])


def _one(value: Any) -> RewardResult | None:
    """A value a function returned for one sample; None stays None (not applicable)."""
    return None if value is None else to_result(value)


def call_function(
    f: RewardFunction,
    tasks: Sequence[Mapping[str, Any]],
    *,
    runner: Runner,
    before_call: Callable[[], None] = lambda: None,
    conversational: bool = False,
) -> list[RewardResult | None]:
    """`f`'s results for `tasks` (dicts with response, answer, extra, prompt, completion_ids):
    None where the function said it does not apply."""
    if f.style == "trl":
        return _call_trl(f, tasks, runner, before_call, conversational)
    calls = []
    results: list[RewardResult | None] = [None] * len(tasks)
    for i, task in enumerate(tasks):
        if f.style == "verl":
            args: tuple[Any, ...] = ()
            kwargs = f.keywords(_verl_arguments(task))
        else:
            args, kwargs = (task["response"], task["answer"]), dict(task["extra"])
        if not f.batched:
            before_call()
            try:
                value = f.fn(*args, **kwargs)
                if inspect.isawaitable(value):
                    value = runner.run(value)
                results[i] = to_result(value)
            except Exception as e:  # a user's reward may raise anything: reported, not hidden
                results[i] = _error(e)
            continue
        try:
            calls.append((i, f.fn(*args, **kwargs)))
        except Exception as e:
            results[i] = _error(e)
    if calls:
        before_call()
        try:
            values = runner.run(_gathered([c for _, c in calls]))
        except Exception as e:
            values = [e] * len(calls)
        for (i, _), value in zip(calls, values, strict=True):
            results[i] = _error(value) if isinstance(value, BaseException) else to_result(value)
    return results


def _verl_arguments(task: Mapping[str, Any]) -> dict[str, Any]:
    extra = dict(task["extra"])
    data_source = extra.pop("data_source", "")
    extra_info = extra["extra_info"] if "extra_info" in extra else extra
    return {
        "data_source": data_source,
        "solution_str": task["response"],
        "ground_truth": task["answer"],
        "extra_info": extra_info,
    }


def _call_trl(f, tasks, runner, before_call, conversational) -> list[RewardResult | None]:
    n = len(tasks)
    columns: dict[str, list[Any]] = {"answer": [t["answer"] for t in tasks]}
    for key in dict.fromkeys(k for t in tasks for k in t["extra"]):
        columns[key] = [t["extra"].get(key) for t in tasks]
    prompts = [t.get("prompt") for t in tasks]
    completions: list[Any] = [t["response"] for t in tasks]
    if conversational:
        completions = [[{"role": "assistant", "content": text}] for text in completions]
        prompts = [[{"role": "user", "content": p}] if isinstance(p, str) else p for p in prompts]
    offered = columns | {
        "prompts": prompts,
        "completions": completions,
        "completion_ids": [list(t.get("completion_ids") or ()) for t in tasks],
        "trainer_state": None,
    }
    before_call()
    try:
        values = f.fn(**f.keywords(offered))
        if inspect.isawaitable(values):
            values = runner.run(values)
    except Exception as e:
        return [_error(e)] * n
    if hasattr(values, "tolist"):  # a numpy array or a tensor
        values = values.tolist()
    if not isinstance(values, (list, tuple)) or len(values) != n:
        shown = (
            f"{len(values)} values" if isinstance(values, (list, tuple)) else type(values).__name__
        )
        reason = (
            f"reward returned {shown}; a TRL-style reward returns a list of {n} (one a completion)"
        )
        return [RewardResult(None, "infra_error", reason)] * n
    return [_one(v) for v in values]


def combine(
    functions: Sequence[RewardFunction], results: Sequence[RewardResult | None]
) -> RewardResult:
    """One sample's result from each function's: the weighted sum of those that apply."""
    if len(functions) == 1:
        (f,), (r,) = functions, results
        if r is None:
            return RewardResult(None, "infra_error", NOT_APPLICABLE)
        if r.status == "ok" and f.weight != 1.0 and r.value is not None:
            return replace(r, value=r.value * f.weight)
        return r
    for status in ("timeout", "infra_error", "invalid_output"):
        for f, r in zip(functions, results, strict=True):
            if r is not None and r.status == status:
                return RewardResult(None, status, f"{f.name}: {r.reason}")  # type: ignore[arg-type]
    applying = [(f, r) for f, r in zip(functions, results, strict=True) if r is not None]
    if not applying:
        return RewardResult(None, "infra_error", NOT_APPLICABLE)
    total = sum(f.weight * float(r.value) for f, r in applying)  # type: ignore[arg-type]
    components: dict[str, float] = {}
    for f, r in applying:
        components[f.name] = float(r.value)  # type: ignore[arg-type]
        components |= {f"{f.name}/{k}": v for k, v in r.components.items()}
    if not math.isfinite(total):
        return RewardResult(None, "infra_error", f"the weighted sum of the rewards is {total}")
    return RewardResult(total, "ok", "", components)


def score_batch(
    functions: Sequence[RewardFunction],
    tasks: Sequence[Mapping[str, Any]],
    *,
    runner: Runner,
    before_call: Callable[[], None] = lambda: None,
    conversational: bool = False,
) -> list[RewardResult]:
    """Every function on `tasks` (each in its form), combined per sample."""
    per_function = [
        call_function(
            f, tasks, runner=runner, before_call=before_call, conversational=conversational
        )
        for f in functions
    ]
    return [combine(functions, list(column)) for column in zip(*per_function, strict=True)]
