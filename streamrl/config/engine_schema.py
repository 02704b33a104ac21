"""The engine sections of the configuration: vLLM's and SGLang's settings, used by the rollout
engines (`rollout.vllm`, `rollout.sglang`) and by a judge's (`reward.judge.vllm`, ...). Part of
`streamrl.config.schema`, which re-exports every name here. Imports no torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from streamrl.config.section import Section

BUILTIN_ENGINES = ("builtin", "vllm", "sglang")


class VllmConfig(Section):
    """The vLLM engine (`rollout.engine=vllm`)."""

    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """vLLM's weight and compute dtype; auto uses `model.dtype`, the trainer's, which keeps the
    rollout/trainer log-prob mismatch smallest."""
    kv_cache_gib: float = Field(1.0, gt=0)
    """vLLM's KV cache size in GiB (host memory on CPU, per device on GPUs)."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt + response vLLM accepts; None uses the model's `max_position_embeddings`."""
    enforce_eager: bool = True
    """Run vLLM without torch.compile and CUDA graphs: starts fast, what CPU runs want; on GPUs
    False is faster once warm."""
    prefix_caching: bool = True
    """Let vLLM share a prompt's attention cache between the samples of its group."""
    in_process: bool = True
    """Run vLLM's engine core inside the rollout process: starts in seconds and passes weights by
    reference. False gives it its own process (weights then travel as a safetensors blob)."""
    engines: int = Field(1, ge=1)
    """vLLM engines behind each rollout service: each group of requests goes to the least-loaded
    one, every weight update to all of them. They decode in parallel only with
    `in_process=false` (an engine-core process each; on GPUs a slice of the visible devices
    each); in-process engines take turns in one thread. `rollout.max_batch_size` and `kv_cache_gib`
    are per engine."""
    engine_kwargs: dict[str, object] = Field(default_factory=dict)
    """Further keyword arguments for `vllm.LLM` (for example `tensor_parallel_size` or
    `gpu_memory_utilization`); they override the settings above."""


class SglangConfig(Section):
    """The SGLang engine (`rollout.engine=sglang`)."""

    url: str | None = None
    """Base URL of a running SGLang server to attach to (e.g. `http://10.0.0.5:30000`); None
    launches one for the policy model and stops it at the end."""
    launch_cmd: list[str] | None = None
    """Command that starts an SGLang server; None is `python -m sglang.launch_server` with this
    interpreter. streamrl appends --model-path, --host, --port, --dtype, --max-running-requests
    (`max_batch_size`) and, with `deterministic`, --enable-deterministic-inference."""
    launch_args: list[str] = Field(default_factory=list)
    """Further arguments for a launched server, e.g. `[--tp, "2", --mem-fraction-static, "0.7"]`."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """`--dtype` of a launched server; auto uses `model.dtype`, the trainer's."""
    deterministic: bool = True
    """Launch with `--enable-deterministic-inference`: without it SGLang ignores the per-request
    seeds, so samples stop being reproducible."""
    startup_timeout_s: float = Field(600.0, gt=0)
    """How long a launched server may take to answer /health before the run fails."""
    request_timeout_s: float = Field(600.0, gt=0)
    """Longest wait for one HTTP call to the server (a whole generation or a weight update)."""
    weights_dir: str | None = None
    """Where weight snapshots (safetensors) are written for /update_weights_from_disk; the server
    must read the same path, so set a shared directory when attaching to another machine. None:
    `<run_dir>/sglang`."""
    weight_sync: Literal["disk", "distributed"] = "disk"
    """How new weights reach the SGLang server. `disk`: a safetensors snapshot in
    `weights_dir` and /update_weights_from_disk (the server must read that directory).
    `distributed`: a torch.distributed group of the rollout process (rank 0) and the server's
    tensor-parallel workers, made on the first update (/init_weights_update_group), then one
    broadcast per tensor with /update_weights_from_distributed; no files. The server must reach
    the rollout process on a free TCP port (its address on the route to the server, 127.0.0.1
    for a launched server); the backend is NCCL when the rollout process has a GPU (the tensors
    go GPU to GPU), gloo otherwise (what the tests use, on CPU)."""
    top_logprobs_num: int = Field(64, ge=1)
    """With rollout.top_p / top_k / min_p on: top log-probs asked per token (top_k's when it is
    smaller), from which the adapter renormalises SGLang's full-distribution log-prob to the
    truncated one; a kept set larger than this is approximated (`num_inexact_logprobs`)."""
