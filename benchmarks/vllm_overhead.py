"""What streamrl's vLLM adapter costs: generation throughput through streamrl vs raw vLLM.

One process, one `vllm.LLM`, the same prompts, sampling seeds and model, timed side by side in
alternating rounds (the median of each path is reported):

- raw vLLM: `LLM.generate` on the token prompts with per-request seeds and the sampled token's
  log-prob (what any RL rollout needs), detokenization off;
- engine adapter: `VllmEngine.generate` (results handed over as they finish, per-token
  versions, a weight poll between scheduler steps as the rollout service does);
- rollout service: `RolloutRole.step` on an in-process bus: claim the prompt rows, generate
  through the adapter, write responses, log-probs and versions back, ack.

Every path must produce the same tokens (checked), so the work is identical and the difference
is overhead. Each path is timed in wall time and in this process's CPU time; the engine runs in
this process, so CPU time counts all of its work and is the steadier figure on a shared machine.
The model is the demo's architecture (built-in tiny Qwen3, default config sizes) with random
weights, so most responses run to `--max-new-tokens`; the prompts are the built-in task's,
`--prompts` of them sampled `--group-size` times each, as in a training batch. The last line
printed is the overhead ratio (streamrl rollout service / raw vLLM), in both clocks.

    .venv/bin/python benchmarks/vllm_overhead.py [--max-new-tokens 24] [--rounds 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from common import demo_model_and_feeder

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of this process")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from streamrl.api import fields as F
    from streamrl.api.engine import SamplingParams
    from streamrl.bus.local import LocalBus
    from streamrl.config.schema import Config, VllmConfig
    from streamrl.rollout.service import RolloutRole, to_requests
    from streamrl.rollout.vllm_engine import VllmEngine
    from streamrl.weights.dcs import InProcessWeights

    cfg = Config().model
    model_dir, tokenizer, feeder = demo_model_and_feeder(
        "vllm-overhead-", prompts=args.prompts, group_size=args.group_size
    )
    num_rows = args.prompts * args.group_size
    engine = VllmEngine(
        model_dir,
        eos_token_id=tokenizer.eos_token_id,
        config=VllmConfig(kv_cache_gib=0.5),
        model_dtype=cfg.dtype,
        max_num_seqs=num_rows,
    )
    params = SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    weights = InProcessWeights()
    weights.publish(0, {})  # version 0, which the engine already holds: nothing to load

    def batch_rows(index: int) -> list[dict]:
        return feeder.batch(index)

    def run_raw(index: int) -> tuple[Clock, list[list[int]]]:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.inputs import TokensPrompt

        from streamrl.rollout.seeds import request_seed

        rows = [{"sample_id": r["sample_id"], **r["fields"]} for r in batch_rows(index)]
        requests = to_requests(rows)
        prompts = [TokensPrompt(prompt_token_ids=r.prompt_ids) for r in requests]
        sampling = [
            VllmSamplingParams(
                max_tokens=params.max_new_tokens,
                temperature=params.temperature,
                seed=request_seed(params.seed, r.request_id),
                logprobs=0,
                flat_logprobs=True,
                detokenize=False,
            )
            for r in requests
        ]
        with Clock() as clock:
            outputs = engine.replicas[0].llm.generate(prompts, sampling, use_tqdm=False)
        return clock, [list(o.outputs[0].token_ids) for o in outputs]

    def run_adapter(index: int) -> tuple[Clock, list[list[int]]]:
        rows = [{"sample_id": r["sample_id"], **r["fields"]} for r in batch_rows(index)]
        requests = to_requests(rows)
        finished = []
        with Clock() as clock:
            results = engine.generate(
                requests,
                params,
                on_finished=finished.extend,
                weight_poll=lambda: weights.fetch_newer(engine.version),
            )
        assert len(finished) == len(results)
        return clock, [r.response_ids for r in results]

    def run_service(index: int) -> tuple[Clock, list[list[int]]]:
        bus = LocalBus()
        bus.register_consumer("rollout")
        bus.add_rows(batch_rows(index))
        written: dict[str, dict] = {}
        bus_write = bus.write

        def write(updates, **kwargs):  # keep a copy: the bus frees rows once they are acked
            written.update(updates)
            return bus_write(updates, **kwargs)

        bus.write = write
        role = RolloutRole(
            bus,
            weights,
            engine,
            params=params,
            max_staleness=10**6,
            max_rows=num_rows,
            inflight_updates=True,
            lease_s=600.0,
        )
        role.inflight_poll_s = 0.0  # ask the weight service at every decode step: worst case
        sample_ids = [r["sample_id"] for r in batch_rows(index)]
        with Clock() as clock:
            assert role.step()
        return clock, [written[s][F.RESPONSE_IDS].tolist() for s in sample_ids]

    paths = {"raw vLLM": run_raw, "engine adapter": run_adapter, "rollout service": run_service}
    for run in paths.values():  # warm-up: the first calls build kernels for new shapes
        run(0)
    wall: dict[str, list[float]] = {name: [] for name in paths}
    cpu: dict[str, list[float]] = {name: [] for name in paths}
    num_tokens = 0
    names = list(paths)
    for round_index in range(1, args.rounds + 1):
        reference = None
        # Rotate the order, so drift in machine load does not favour one path, and start every
        # run from an empty prefix cache, so no path reuses the prompts' attention of another.
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            engine.replicas[0].llm.reset_prefix_cache()
            clock, tokens = paths[name](round_index)
            if reference is None:
                reference = tokens
                num_tokens = sum(len(t) for t in tokens)
            elif tokens != reference:
                raise AssertionError(f"{name} sampled other tokens than the other paths")
            wall[name].append(clock.wall_s)
            cpu[name].append(clock.cpu_s)

    print(
        f"model: built-in tiny Qwen3 (hidden {cfg.hidden_size}, {cfg.num_layers} layers), "
        f"{cfg.dtype}; {num_rows} requests ({args.prompts} prompts x {args.group_size}), "
        f"{num_tokens} tokens per round, temperature {args.temperature}, "
        f"median of {args.rounds} rounds, torch threads {args.threads}"
    )
    raw_wall, raw_cpu = statistics.median(wall["raw vLLM"]), statistics.median(cpu["raw vLLM"])
    print(f"{'path':<16} {'wall s':>7} {'tokens/s':>9} {'vs raw':>7} {'cpu s':>7} {'vs raw':>7}")
    for name in names:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(
            f"{name:<16} {w:>7.3f} {num_tokens / w:>9.0f} {w / raw_wall:>7.3f} "
            f"{c:>7.3f} {c / raw_cpu:>7.3f}"
        )
    service_wall = statistics.median(wall["rollout service"])
    service_cpu = statistics.median(cpu["rollout service"])
    print(
        "overhead ratio (streamrl rollout service / raw vLLM): "
        f"wall time {service_wall / raw_wall:.3f}, CPU time {service_cpu / raw_cpu:.3f}"
    )


class Clock:
    """Wall time and this process's CPU time of a `with` block. CPU time is the steadier figure
    on a shared machine: other processes' load stretches wall time, not this process's work."""

    def __enter__(self) -> Clock:
        self._wall, self._cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._wall
        self.cpu_s = time.process_time() - self._cpu


if __name__ == "__main__":
    main()
