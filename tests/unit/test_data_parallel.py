"""Two data-parallel ranks (gloo on CPU), each accumulating its own uneven micro-batches, end a
step with the same parameters as one process that saw the whole batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.distributed import free_port, gloo_group
from tests.unit.test_grpo import (
    grads,
    make_learner,
    params,
    random_rows,
    skip_zero_advantage,
)

pytestmark = pytest.mark.timeout(120)

ROWS = 9
SPLITS = {0: [(0, 1), (1, 4)], 1: [(4, 9)]}  # rank -> its micro-batches (uneven)


def rank_main(rank: int, path: str, port: int, loss_agg: str, out_dir: str) -> None:
    with gloo_group(rank, 2, port):
        learner = make_learner(Path(path), loss_agg)
        rows = random_rows(ROWS)
        for lo, hi in SPLITS[rank]:
            kept, share = skip_zero_advantage(rows[lo:hi], loss_agg)
            learner.accumulate(kept, num_skipped_tokens=share)
        for p in learner.model.parameters():  # what DDP / FSDP2 do: average over ranks
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        learner.step()
        torch.save(params(learner), Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.parametrize("loss_agg", ["token_mean", "seq_mean_token_mean", "constant"])
def test_two_ranks_equal_one_full_batch(model_dir: Path, tmp_path: Path, loss_agg: str) -> None:
    mp.spawn(rank_main, args=(str(model_dir), free_port(), loss_agg, str(tmp_path)), nprocs=2)
    whole = make_learner(model_dir, loss_agg)
    whole.accumulate(random_rows(ROWS))
    assert grads(whole)
    whole.step()
    expected = params(whole)
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, atol=1e-6, rtol=1e-5, msg=name)
