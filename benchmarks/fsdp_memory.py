"""Peak memory per trainer rank when FSDP2 ranks load a model: every rank loading the whole
checkpoint (how ranks loaded before `load_sharded_model`) against rank 0 loading it and sending
each rank its shards, at world size 1 and 2 (and more with `--world-sizes`), in one run.

Each configuration runs in fresh processes (one per rank, gloo on CPU, one thread each) on a
built-in Qwen3 model with random weights of the size asked for (default: hidden 512, 6 layers,
about 19 M parameters). Every rank measures, with `process_peak_bytes` (the process's
resident-set high-water mark):

- `before`: its resident memory before any weight exists (interpreter, torch, transformers'
  model classes imported, process group joined);
- `load`: its peak once the model is loaded and sharded (rank 0 also holding the unsharded CPU
  copy `RankedLearner` keeps for evaluation and checkpoints);
- `step`: its peak after one training step (AdamW state, gradients, activations of 4 rows of 48
  tokens per rank) and the weight sync after it (`named_weights`: full weights gathered to rank
  0, which refreshes its copy with them and hands them to the weight channel, as
  `RankedLearner` does; it used to hand over a clone, one more full model).

`added` is `step - before`: what the model cost the rank. transformers maps the safetensors
file and a loaded model's pages become resident only when read, so a peak counts the weights a
rank really touched (the old path's full model on every rank is read while sharding it).
Configurations:

- `one process`: `trainer.world_size=1` as the trainer runs it (a `Learner`, no FSDP, no copy);
- `every rank`: each rank loads the full model and shards it; rank 0 loads a second full copy
  and publishes a clone of the gathered weights (the previous `RankedLearner`);
- `rank 0`: rank 0 loads the model once (the copy); every rank builds on the meta device and
  receives its shards (`load_sharded_model`, the current `RankedLearner`).

    python benchmarks/fsdp_memory.py [--hidden-size 512] [--num-layers 6] [--num-heads 8]
                                     [--world-sizes 1 2]
"""

from __future__ import annotations

import argparse
import json
import socket
import tempfile
from pathlib import Path

GIB = 2**30


def _rows(num: int) -> list[dict]:
    """Rows the learner trains on: 16 prompt and 32 response tokens each, off the policy."""
    return [
        {
            "prompt_ids": [5 + (i + t) % 50 for t in range(16)],
            "response_ids": [7 + (3 * i + t) % 50 for t in range(32)],
            "rollout_logprobs": [-5.0] * 32,
            "advantages": 1.0 if i % 2 == 0 else -1.0,
        }
        for i in range(num)
    ]


def rank_main(rank: int, world: int, loading: str, model_dir: str, port: int, out: str) -> None:
    import psutil
    import torch

    from streamrl.config.schema import PolicyLossConfig
    from streamrl.metrics.memory import process_peak_bytes
    from streamrl.models.loading import load_causal_lm
    from streamrl.trainer.algos.objective import LossSettings
    from streamrl.trainer.fsdp import (
        FSDPLearner,
        data_parallel_mesh,
        empty_causal_lm,
        init_distributed,
        load_sharded_model,
        shard_model,
    )
    from streamrl.trainer.learner import Learner

    torch.set_num_threads(1)
    torch.manual_seed(0)
    sharded = loading != "one process"
    if sharded:
        init_distributed(rank, world, f"tcp://127.0.0.1:{port}")
    empty_causal_lm(model_dir)  # the model classes imported, no weights: every variant pays it
    before = psutil.Process().memory_info().rss
    copy = None
    if loading == "one process":
        model = load_causal_lm(model_dir)
    elif loading == "every rank":
        model = shard_model(load_causal_lm(model_dir), data_parallel_mesh())
        copy = load_causal_lm(model_dir) if rank == 0 else None
    else:
        copy = load_causal_lm(model_dir) if rank == 0 else None
        model = load_sharded_model(model_dir, data_parallel_mesh(), copy)
    loaded = process_peak_bytes()
    learner = (FSDPLearner if sharded else Learner)(
        model,
        pad_token_id=0,
        lr=1e-5,
        weight_decay=0.0,
        grad_clip=1.0,
        temperature=1.0,
        settings=LossSettings(loss=PolicyLossConfig(agg="token_mean")),
    )
    learner.accumulate(_rows(4 * world)[rank::world])
    learner.step()
    weights = learner.named_weights()  # rank 0 only; the others join the gathers
    if copy is not None:  # what RankedLearner.named_weights does with them
        params = dict(copy.named_parameters())
        with torch.no_grad():
            for name, value in weights.items():
                params[name].copy_(value)
        if loading == "every rank":  # it also published a clone of the gathered weights
            published = {name: value.clone() for name, value in weights.items()}
            del published
    stepped = process_peak_bytes()
    record = {"before": before, "load": loaded, "step": stepped, "copy": copy is not None}
    Path(out, f"rank{rank}.json").write_text(json.dumps(record))
    if sharded:
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(world: int, loading: str, model_dir: Path, tmp: Path) -> list[dict]:
    import torch.multiprocessing as mp

    out = tmp / f"{loading.replace(' ', '_')}-{world}"
    out.mkdir()
    args = (world, loading, str(model_dir), _free_port(), str(out))
    mp.spawn(rank_main, args=args, nprocs=world)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--num-layers", type=int, default=6)
    parser.add_argument("--num-heads", type=int, default=8)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()

    from streamrl.models.tiny import build_tiny_model_dir

    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        model_dir = build_tiny_model_dir(
            tmp / "model",
            hidden_size=args.hidden_size,
            num_layers=args.num_layers,
            num_heads=args.num_heads,
            seed=0,
        )
        weights_bytes = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
        print(
            f"model: hidden {args.hidden_size}, {args.num_layers} layers, "
            f"{weights_bytes / 4 / 1e6:.1f} M parameters, {weights_bytes / GIB:.3f} GiB in fp32"
        )
        print(
            f"{'world':>5} {'loading':12} {'rank':>4} {'before':>7} {'load':>7} {'step':>7} "
            f"{'added':>7}  (GiB; rank 0 holds the unsharded copy where marked *)"
        )
        for world in args.world_sizes:
            for loading in ("one process",) if world == 1 else ("every rank", "rank 0"):
                for rank, r in enumerate(measure(world, loading, model_dir, tmp)):
                    print(
                        f"{world:>5} {loading:12} {rank:>4}{'*' if r['copy'] else ' '}"
                        f"{r['before'] / GIB:>6.3f} {r['load'] / GIB:>7.3f} "
                        f"{r['step'] / GIB:>7.3f} {(r['step'] - r['before']) / GIB:>7.3f}"
                    )


if __name__ == "__main__":
    main()
