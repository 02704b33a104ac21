"""Episodes through the real `AgentRunner` and the builtin engine on the tiny model.

The ledger property the trainer relies on: every trained sample of a multi-turn episode holds the
engine's sampled tokens verbatim, the loss mask is 1 on exactly those, and the trainer's
log-probs of them (under the weights of each token's recorded version) match the engine's, also
for turns cut by an in-flight weight update and turns sampled after an update between turns.
Then the scheduler's controls: engine retries with backoff, the turn deadline, the priority order.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from streamrl.agents.chat import chat_format
from streamrl.agents.episode import Episode, Task
from streamrl.agents.ledger import segment_fields
from streamrl.agents.runner import AgentRunner
from streamrl.api import fields as F
from streamrl.api.engine import SamplingParams
from streamrl.config.agent_schema import AgentConfig
from streamrl.models.loading import load_causal_lm
from streamrl.models.tiny import build_tiny_model_dir
from streamrl.models.tokenizer import build_tokenizer
from streamrl.rollout.builtin_engine import BuiltinEngine
from streamrl.trainer.logprobs import pack, response_logprobs

CHAT = chat_format("streamrl")
TURNS = 3
PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0)


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def policies(model_dir):
    """Versions 0, 1, 2 of the policy: the tiny model and two perturbations of it."""
    base = load_causal_lm(model_dir).eval()
    out = [base]
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        nxt = copy.deepcopy(out[-1])
        with torch.no_grad():
            for p in nxt.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        out.append(nxt)
    return out


class Recording:
    """The builtin engine, recording what each generate call returned (and failing the first
    `failures` calls, like an engine server that is restarting)."""

    def __init__(self, engine: BuiltinEngine, *, failures: int = 0, delay_s: float = 0.0):
        self.engine, self.failures, self.delay_s = engine, failures, delay_s
        self.results: dict[str, list[int]] = {}
        self.calls: list[list[str]] = []

    @property
    def version(self) -> int:
        return self.engine.version

    def load_weights(self, version, named_tensors) -> None:
        self.engine.load_weights(version, named_tensors)

    def generate(self, requests, params, *, on_finished=None, weight_poll=None):
        self.calls.append([r.request_id for r in requests])
        if self.failures:
            self.failures -= 1
            raise ConnectionError("engine server restarting")
        time.sleep(self.delay_s)
        results = self.engine.generate(
            requests, params, on_finished=on_finished, weight_poll=weight_poll
        )
        for r in results:
            self.results[r.request_id] = list(r.response_ids)
        return results


def make_engine(policies, tok, **kwargs) -> Recording:
    engine = BuiltinEngine(
        copy.deepcopy(policies[0]),
        tokenizer=tok,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return Recording(engine, **kwargs)


def tasks(tok, n: int) -> list[Task]:
    out = []
    for i in range(n):
        text = CHAT.render(
            [{"role": "user", "content": f"{12 + i}*{34 + i}="}], add_generation_prompt=True
        )
        ids = tok(text, add_special_tokens=False)["input_ids"]
        out.append(Task(f"s{i}", ids, answer="0", group_id=f"g{i // 2}"))
    return out


async def three_turns(task, client) -> Episode:
    """Whatever the (random) model says, show it a tool result and ask again: three turns."""
    for n in range(TURNS):
        turn = await client.turn()
        if n < TURNS - 1:
            client.add_messages([{"role": "tool", "name": "calculate", "content": f"{n}7"}])
    return Episode(final_text=turn.content, reward=1.0)


def runner(engine, tok, **cfg) -> AgentRunner:
    cfg = AgentConfig(enabled=True, max_turns=TURNS, max_total_tokens=200, **cfg)
    out = AgentRunner(engine, tok, cfg)
    out.workflow = three_turns
    return out


def ledger_gaps(done, engine: Recording, policies, tok) -> tuple[list[float], list[int]]:
    """Check one finished episode's sample against what the engine returned; its log-prob gaps
    (trainer vs engine, under each token's version) and the versions of its first turn."""
    seg = done.client.ledger.current
    fields = segment_fields(seg)
    mask = fields[F.LOSS_MASK].astype(bool)
    assert done.episode.status == "ok" and done.client.num_turns == TURNS
    # The sampled spans, in order, are exactly the engine's tokens of the episode's turns.
    sampled = [engine.results[f"{done.task.sample_id}/t{n}"] for n in range(TURNS)]
    assert fields[F.RESPONSE_IDS][mask].tolist() == sum(sampled, [])
    assert mask.sum() == sum(len(s) for s in sampled) and (~mask).sum() > 0
    assert np.all(fields[F.ROLLOUT_LOGPROBS][~mask] == 0)
    gaps = []
    for version in set(fields[F.VERSIONS][mask].tolist()):
        batch = pack([seg.prompt_ids], [seg.ids], tok.pad_token_id)
        with torch.no_grad():
            want = response_logprobs(policies[version], batch, PARAMS.temperature)[0].numpy()
        at = mask & (fields[F.VERSIONS] == version)
        gaps += np.abs(fields[F.ROLLOUT_LOGPROBS][at] - want[at]).tolist()
    return gaps, fields[F.VERSIONS][mask][: len(sampled[0])].tolist()


def test_trained_tokens_are_the_sampled_ones_with_the_engines_logprobs(policies, tok) -> None:
    engine = make_engine(policies, tok)
    weights = [dict(p.named_parameters()) for p in policies]
    polls = 0

    def weight_poll():  # version 1 lands inside the first turn, after its fourth token
        nonlocal polls
        polls += 1
        return (1, weights[1]) if polls == 4 and engine.version == 0 else None

    def before_call():  # version 2 lands between turns, before the third
        if len(engine.calls) == 2:
            engine.load_weights(2, weights[2])

    finished = runner(engine, tok).run(
        tasks(tok, 4), PARAMS, before_call=before_call, weight_poll=weight_poll
    )
    assert engine.version == 2
    gaps, versions_seen, cut_turns = [], set(), 0
    for done in finished:
        got, first_turn = ledger_gaps(done, engine, policies, tok)
        gaps += got
        versions_seen |= set(done.client.ledger.current.versions)
        cut_turns += len(set(first_turn)) > 1
    assert versions_seen == {0, 1, 2}
    assert cut_turns > 0  # some first turns hold tokens of versions 0 and 1
    assert float(np.mean(gaps)) <= 1e-3, float(np.mean(gaps))


@pytest.fixture(scope="module")
def wide_model_dir(tmp_path_factory) -> Path:
    """A tiny model with head_dim 32 (vLLM's CPU attention wants multiples of 16)."""
    out = tmp_path_factory.mktemp("wide")
    return build_tiny_model_dir(out, hidden_size=64, num_layers=1, num_heads=2, seed=0)


@pytest.mark.parametrize("name", ["builtin", "vllm", "sglang"])
def test_episodes_run_token_in_token_out_on_every_engine(
    name, wide_model_dir, tok, tmp_path
) -> None:
    """The same episodes on each rollout engine (vLLM's CPU build in this process; the SGLang
    adapter against the contract suite's stand-in server): continuations of the ledger's ids,
    and the engine's log-probs are the trainer's."""
    from tests.contract import engines_under_test as engines

    start = {"builtin": engines.start_builtin, "vllm": engines.start_vllm}.get(
        name, engines.start_sglang
    )
    subject = start(wide_model_dir, tok.eos_token_id, tmp_path)
    try:
        engine = Recording(subject.engine)
        finished = runner(engine, tok).run(tasks(tok, 3), PARAMS)
    finally:
        subject.close()
    policy = load_causal_lm(wide_model_dir).eval()
    gaps = sum((ledger_gaps(done, engine, [policy], tok)[0] for done in finished), [])
    assert float(np.mean(gaps)) <= 1e-3, float(np.mean(gaps))


def test_turns_of_different_episodes_share_engine_calls(policies, tok) -> None:
    engine = make_engine(policies, tok)
    runner(engine, tok).run(tasks(tok, 6), PARAMS)
    assert len(engine.calls[0]) == 6  # the first turns of all six episodes in one call
    assert sum(len(c) for c in engine.calls) == 6 * TURNS
    assert len(engine.calls) < 6 * TURNS


def test_an_engine_call_that_fails_is_retried_with_backoff(policies, tok) -> None:
    engine = make_engine(policies, tok, failures=2)
    started = time.perf_counter()
    finished = runner(engine, tok, engine_retries=2).run(tasks(tok, 2), PARAMS)
    assert [d.episode.status for d in finished] == ["ok", "ok"]
    assert time.perf_counter() - started >= 0.5 + 1.0  # two backoffs: 0.5 s then 1 s
    assert engine.calls[0] == engine.calls[1] == engine.calls[2]


def test_an_engine_failing_past_its_retries_fails_the_run(policies, tok) -> None:
    engine = make_engine(policies, tok, failures=2)
    with pytest.raises(ConnectionError):
        runner(engine, tok, engine_retries=1).run(tasks(tok, 2), PARAMS)


def test_a_turn_past_its_deadline_drops_the_episode_with_its_reason(policies, tok) -> None:
    engine = make_engine(policies, tok, delay_s=0.5)
    finished = runner(engine, tok, turn_timeout_s=0.2).run(tasks(tok, 2), PARAMS)
    for done in finished:
        assert done.episode.status == "turn_timeout" and "turn_timeout_s" in done.episode.reason
        assert done.episode.reward is None


def test_oldest_version_first_serves_the_starved_episode_first(policies, tok) -> None:
    """Queued requests run oldest policy version first: an episode still holding version-0
    tokens goes ahead of episodes that started under version 1."""
    import asyncio

    from streamrl.agents.scheduler import TurnScheduler

    engine = make_engine(policies, tok)
    order: list[str] = []

    async def main(priority):
        scheduler = TurnScheduler(engine, PARAMS, priority=priority)
        from streamrl.api.engine import GenerationRequest

        ids = tasks(tok, 1)[0].prompt_ids
        waits = [
            scheduler.generate(GenerationRequest(rid, ids), version)
            for rid, version in (("new-a", 1), ("new-b", 1), ("old", 0), ("fresh", None))
        ]
        serving = asyncio.create_task(scheduler.run())
        await asyncio.gather(*waits)
        scheduler.close()
        await serving

    for priority in ("oldest_version", "fifo"):
        engine.calls.clear()
        asyncio.run(main(priority))
        order.append(",".join(engine.calls[0]))
    assert order == ["old,new-a,new-b,fresh", "new-a,new-b,old,fresh"]


class Countdown:
    """A test environment: a counter set from the seed; each step counts down, rewards 0.25 and
    is done at zero. Records every instance's seed and whether it was closed."""

    made: list[Countdown] = []

    def __init__(self):
        self.seed, self.closed, self.left = None, False, 0
        Countdown.made.append(self)

    def reset(self, seed, task) -> None:
        self.seed, self.left = seed, 2 + seed % 2

    async def step(self, action: str):
        self.left -= 1
        return f"{self.left} left", 0.25, self.left == 0

    def close(self) -> None:
        self.closed = True


def test_env_loop_seeds_groups_alike_and_sums_step_rewards(policies, tok) -> None:
    from streamrl.agents.episode import group_seed

    Countdown.made.clear()
    engine = make_engine(policies, tok)
    cfg = AgentConfig(
        enabled=True,
        workflow="env_loop",
        environment=f"{__name__}:Countdown",
        max_turns=5,
        max_total_tokens=400,
    )
    finished = AgentRunner(engine, tok, cfg).run(tasks(tok, 4), PARAMS)
    seeds = [env.seed for env in Countdown.made]
    assert seeds == [group_seed(t.group_id) for t in tasks(tok, 4)]
    assert seeds[0] == seeds[1] != seeds[2] == seeds[3]  # a group shares its start state
    assert all(env.closed for env in Countdown.made)
    for done, env in zip(finished, Countdown.made, strict=True):
        steps = 2 + env.seed % 2
        assert done.client.num_turns == steps and done.episode.turn_rewards == [0.25] * steps
        assert done.episode.reward == 0.25 * steps
        shown = tok.decode([t for t, m in zip(*_ids_mask(done), strict=True) if not m])
        assert f"{steps - 1} left" in shown  # the observation went back as a user turn


def _ids_mask(done):
    seg = done.client.ledger.current
    return seg.ids, seg.mask
