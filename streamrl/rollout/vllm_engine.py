"""The vLLM rollout engine (`rollout.engine=vllm`): the Engine protocol over one or more `vllm.LLM`.

Token ids go in, token ids come out with the log-prob of every sampled token and the policy
version that produced it. How one `vllm.LLM` is started, fed and reloaded (processed log-probs,
per-request seeds, synchronous scheduling, in-place weight reload) is `rollout/vllm_replica.py`;
this module is the generation loop over `rollout.vllm.engines` of them.

Each vLLM request reports once, when it finishes: per-step outputs would cost more than a small
model's forward pass. An in-flight weight update (the protocol's `weight_poll`, asked between
steps) reads the tokens every unfinished request has so far, aborts them all, loads the weights,
and resubmits each request as a continuation: its prompt plus its tokens so far, with the
remaining token budget and a seed derived from (`request_id`, tokens so far). The continuation's
prefill recomputes the attention cache under the new weights, so no token is drawn from attention
state of an older policy, and each token records the version it was sampled with.

Several engines: `generate` routes each group of requests that share a prompt to the
least-loaded engine (`rollout/balancer.py`; route to one); a weight update goes to every engine
(fan out to all; each keeps its own version, and a token is stamped with the version of the
engine that sampled it); an in-flight update aborts and resumes the requests of every engine,
and a continuation may land on another engine. Engines with their own processes
(`in_process=False`) decode in parallel; on GPUs each gets its own slice of the visible devices.
In-process engines share this thread and take turns, which is correct but no faster than one
(docs/engines.md).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from streamrl.api.engine import (
    GenerationRequest,
    GenerationResult,
    SamplingParams,
    WeightPoll,
    check_requests,
)
from streamrl.api.fields import ROUTED_EXPERTS
from streamrl.config.schema import VllmConfig
from streamrl.rollout.balancer import LeastLoaded, Unit, group_by_prompt
from streamrl.rollout.sampling import StopStrings, cut_at_stop
from streamrl.rollout.vllm_replica import Replica, SequenceState, as_tensor, engine_envs

__all__ = ["CPU_HEAD_SIZES", "VllmEngine"]

# Head dimensions vLLM's CPU attention runs (vLLM 0.32, `CPUAttentionBackend.
# get_supported_head_sizes`; a unit test checks the installed vLLM says the same). Kept here
# because the pre-run check should not spend the seconds importing vLLM takes.
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


# In-process engines share vLLM's module-level torch.distributed groups: the first one creates
# them, and only the last one to close may tear them down.
_num_in_process_open = 0


class VllmEngine:
    """A rollout engine backed by vLLM (`rollout.engine=vllm`): `config.engines` vLLM engines,
    requests routed to the least-loaded one, weights loaded into all of them.

    `config` is the `rollout.vllm` section; the values from other sections come separately:
    `model_dtype` (`model.dtype`, what `config.dtype="auto"` runs in), `max_num_seqs` (vLLM's,
    `rollout.max_batch_size`: per engine) and `seed` (vLLM's global seed, `run.seed`; the
    per-request seeds decide the samples)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        eos_token_id: int,
        config: VllmConfig,
        model_dtype: str = "float32",
        max_num_seqs: int = 256,
        seed: int = 0,
        capture_routes: bool = False,
    ):
        global _num_in_process_open
        if config.engines < 1:
            raise ValueError(f"rollout.vllm.engines must be >= 1, got {config.engines}")
        self.eos_token_id = eos_token_id
        self.config = config
        self.dtype = model_dtype if config.dtype == "auto" else config.dtype
        self.max_num_seqs = max_num_seqs
        self.replicas: list[Replica] = []
        try:
            for index, env in enumerate(engine_envs(config)):
                replica = Replica(
                    index,
                    Path(model_dir),
                    config,
                    env,
                    dtype=self.dtype,
                    max_num_seqs=max_num_seqs,
                    seed=seed,
                    capture_routes=capture_routes,
                )
                self.replicas.append(replica)
                _num_in_process_open += replica.workers_in_process
        except BaseException:
            self.close()
            raise
        self.max_model_len = min(r.max_model_len for r in self.replicas)
        self.vocab_size: int = self.replicas[0].engine.model_config.get_vocab_size()
        self.balancer = LeastLoaded(len(self.replicas), capacity=max_num_seqs)
        self.num_weight_updates = 0
        self.num_continuations = 0

    @property
    def version(self) -> int:
        """The oldest version any engine holds (they hold the same one between calls)."""
        return min(r.version for r in self.replicas)

    @property
    def requests_per_engine(self) -> list[int]:
        """Requests (continuations included) each engine has been given so far."""
        return list(self.balancer.routed)

    def load_weights(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        """Reload every given weight in place, in every engine (fan out to all); only call it
        while no request is running."""
        tensors = {name: as_tensor(value) for name, value in named_tensors.items()}
        by_reference: Any = None
        blob: Any = None
        for replica in self.replicas:
            if replica.workers_in_process:
                by_reference = by_reference or list(tensors.items())
                replica.load_weights(version, by_reference)
            else:
                from safetensors.torch import save

                blob = blob or save(tensors)
                replica.load_weights(version, blob)
        self.num_weight_updates += 1

    def generate(
        self,
        requests: Sequence[GenerationRequest],
        params: SamplingParams,
        *,
        on_finished: Callable[[list[GenerationResult]], None] | None = None,
        weight_poll: WeightPoll | None = None,
    ) -> list[GenerationResult]:
        if len({r.request_id for r in requests}) != len(requests):
            raise ValueError("request ids in one generate() call must be unique")
        # Here, not in vLLM: its own check raises a VLLMValidationError (not a ValueError) that
        # does not name the request, once earlier requests of the call already run.
        check_requests(requests, self.vocab_size)
        for r in requests:
            if len(r.prompt_ids) + params.max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"request {r.request_id!r}: {len(r.prompt_ids)} prompt tokens + "
                    f"{params.max_new_tokens} new tokens exceed vLLM's max_model_len "
                    f"{self.max_model_len}; raise rollout.vllm.max_model_len or shorten prompts"
                )
        # vLLM matches stop strings within one attempt; across the attempts of a resumed
        # request (a string split by an in-flight update) this check finds them.
        stops = (
            StopStrings(self.replicas[0].llm.get_tokenizer(), params.stop) if params.stop else None
        )
        pending = deque(self._units([SequenceState(r) for r in requests], params))
        results: dict[str, GenerationResult] = {}
        num_steps = 0
        try:
            while pending or self._busy():
                self._dispatch(pending, params)
                assert self._busy(), "work is pending but no engine runs or takes any"
                finished: list[SequenceState] = []
                if weight_poll is not None and num_steps > 0:
                    update = weight_poll()
                    if update is not None:
                        finished += self._update_in_flight(update, params, pending, stops)
                        self._dispatch(pending, params)
                for replica in self._busy():
                    done = replica.step()
                    for seq in done:
                        self.balancer.finish(replica.index, 1, seq.cost)
                    finished += done
                num_steps += 1
                for seq in finished:
                    if seq.attempt > 0:
                        _end_at_stop(seq, params, self.eos_token_id, stops)
                    results[seq.request.request_id] = self._result(seq)
                if finished and on_finished is not None:
                    on_finished([results[seq.request.request_id] for seq in finished])
        except BaseException:
            self._abandon()
            raise
        return [results[r.request_id] for r in requests]

    def close(self) -> None:
        """Stop every vLLM engine core (and its processes, when it has any). The last in-process
        engine to close also leaves the torch.distributed group vLLM made, so this process can
        start another."""
        global _num_in_process_open
        replicas, self.replicas = self.replicas, []
        for replica in replicas:
            replica.close()
            _num_in_process_open -= replica.workers_in_process
        if any(r.workers_in_process for r in replicas) and _num_in_process_open == 0:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()

    def _busy(self) -> list[Replica]:
        return [r for r in self.replicas if r.running]

    def _units(self, sequences: list[SequenceState], params: SamplingParams) -> list[Unit]:
        """Routing units: the sequences that feed vLLM the same prompt (a group's samples),
        each costing its prompt plus its remaining token budget."""
        for seq in sequences:
            seq.cost = len(seq.prompt) + params.max_new_tokens - len(seq.response_ids)
        return group_by_prompt(sequences, lambda s: s.prompt, lambda s: s.cost)

    def _dispatch(self, pending: deque[Unit], params: SamplingParams) -> None:
        """Hand pending units to the least-loaded engines while any has room (route to one)."""
        while pending:
            index = self.balancer.pick()
            if index is None:
                return
            unit = pending.popleft()
            for seq in unit.items:
                self.replicas[index].submit(seq, params)
            self.balancer.start(index, len(unit.items), unit.cost)

    def _update_in_flight(
        self,
        update: tuple[int, Mapping[str, Any]],
        params: SamplingParams,
        pending: deque[Unit],
        stops: StopStrings | None,
    ) -> list[SequenceState]:
        """Record what every engine's running requests have so far, abort them all, load the
        new weights into every engine, and queue each unfinished request as a continuation ahead
        of the work not yet started. Returns sequences that turn out to be complete."""
        sequences = []
        for replica in self.replicas:
            aborted = replica.abort_all()
            self.balancer.finish(replica.index, len(aborted), sum(s.cost for s in aborted))
            sequences += aborted
        self.load_weights(*update)
        complete, resumed = [], []
        for seq in sequences:
            if _end_at_stop(seq, params, self.eos_token_id, stops) or (
                len(seq.response_ids) >= params.max_new_tokens
            ):
                complete.append(seq)
                continue
            seq.attempt += 1
            resumed.append(seq)
            self.num_continuations += 1
        pending.extendleft(reversed(self._units(resumed, params)))
        return complete

    def _abandon(self) -> None:
        """After a failure mid-generate: abort whatever still runs, so the engines (and the
        balancer's counts) are clean for the next call."""
        for replica in self.replicas:
            sequences = list(replica.running.values())
            replica.running.clear()
            self.balancer.finish(replica.index, len(sequences), sum(s.cost for s in sequences))
            if sequences:
                # Best effort: the error that stopped generate() is the one that propagates.
                with contextlib.suppress(Exception):
                    replica.engine.abort_request([s.vllm_id for s in sequences])

    def _result(self, seq: SequenceState) -> GenerationResult:
        ids = seq.response_ids
        result = GenerationResult(
            request_id=seq.request.request_id,
            response_ids=ids,
            logprobs=seq.logprobs,
            versions=seq.versions,
            finish_reason="stop" if seq.stopped else "length",
            extra={"engines": seq.engines},
        )
        if seq.routes is not None:  # every position but the last token's (a stop may cut it)
            result.extra[ROUTED_EXPERTS] = seq.routes[: len(seq.request.prompt_ids) + len(ids) - 1]
        return result


def _end_at_stop(
    seq: SequenceState, params: SamplingParams, eos_token_id: int, stops: StopStrings | None
) -> bool:
    """Cut `seq` after the first stop among its tokens (marking it stopped); whether it has one."""
    cut = cut_at_stop(seq.response_ids, params, eos_token_id, stops)
    if cut is None:
        return seq.stopped
    del seq.response_ids[cut:], seq.logprobs[cut:], seq.versions[cut:]
    seq.stopped = True
    return True
