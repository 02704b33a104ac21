"""Splitting a step's rows into micro-batches under a token budget, and dealing them to ranks.

Pure functions of the rows' lengths, so every data-parallel rank computes the same plan from the
same step without talking to the others. A micro-batch's cost is what its forward allocates:

- `padded=True`: rows x (longest prompt + longest response), the `[B, T]` batch that
  `trainer.logprobs.pack` builds (left-padded prompts, right-padded responses);
- `padded=False`: the sum of prompt + response tokens, what a padding-free forward would see.

Packing is first-fit decreasing: rows sorted by length (longest first, ties by index), each put
into the first micro-batch it fits. Sorting also groups similar lengths, which keeps padding low.
Under FSDP every rank must run the same number of micro-batches (each one is a round of
collectives), so `plan_step` pads ranks that run out with empty micro-batches.

`padding_free_logprobs` is the forward that the `padded=False` cost describes: the rows laid end
to end in one `[1, T]` sequence whose position ids restart at 0 for each row. Transformers reads
the restarts as sequence boundaries (a block-diagonal causal mask with SDPA, variable-length
kernels with flash attention), and the result has the same layout as
`trainer.logprobs.response_logprobs`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def micro_batch_cost(
    prompt_lens: Sequence[int], response_lens: Sequence[int], rows: Sequence[int], *, padded: bool
) -> int:
    """Tokens the forward of the micro-batch `rows` (indices) processes."""
    if not rows:
        return 0
    if padded:
        width = max(prompt_lens[i] for i in rows) + max(response_lens[i] for i in rows)
        return len(rows) * width
    return sum(prompt_lens[i] + response_lens[i] for i in rows)


def split_by_token_budget(
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    max_tokens: int,
    *,
    padded: bool = True,
) -> list[list[int]]:
    """Row indices grouped into micro-batches of cost at most `max_tokens`; deterministic.

    Each micro-batch lists its rows in ascending order; micro-batches come in the order they
    were opened (the one with the longest row first)."""
    if len(prompt_lens) != len(response_lens):
        raise ValueError(
            f"got {len(prompt_lens)} prompt lengths but {len(response_lens)} response lengths; "
            "pass one of each per row"
        )
    if max_tokens <= 0:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    order = sorted(range(len(prompt_lens)), key=lambda i: (-(prompt_lens[i] + response_lens[i]), i))
    bins: list[list[int]] = []
    for i in order:
        if prompt_lens[i] + response_lens[i] > max_tokens:
            raise ValueError(
                f"row {i} has {prompt_lens[i] + response_lens[i]} tokens, more than "
                f"max_tokens={max_tokens}; set the budget to at least the longest prompt plus "
                "the longest response"
            )
        for rows in bins:
            if (
                micro_batch_cost(prompt_lens, response_lens, [*rows, i], padded=padded)
                <= max_tokens
            ):
                rows.append(i)
                break
        else:
            bins.append([i])
    return [sorted(rows) for rows in bins]


def deal_to_ranks(
    micro_batches: Sequence[list[int]], costs: Sequence[int], num_ranks: int
) -> list[list[list[int]]]:
    """Deal micro-batches to `num_ranks` ranks: `[rank][k]` is rank's k-th micro-batch.

    Micro-batches go out in rounds of `num_ranks`, most expensive first; within a round the
    costliest goes to the rank with the least work so far (ties to the lower rank). Every rank
    gets the same number of micro-batches; the last round is padded with empty ones."""
    if num_ranks <= 0:
        raise ValueError(f"num_ranks must be positive, got {num_ranks}")
    if len(micro_batches) != len(costs):
        raise ValueError(f"got {len(micro_batches)} micro-batches but {len(costs)} costs")
    order = sorted(range(len(micro_batches)), key=lambda k: (-costs[k], k))
    plan: list[list[list[int]]] = [[] for _ in range(num_ranks)]
    load = [0] * num_ranks
    for start in range(0, len(order), num_ranks):
        round_ = order[start : start + num_ranks]
        ranks = sorted(range(num_ranks), key=lambda r: (load[r], r))
        for rank, k in zip(ranks, round_, strict=False):
            plan[rank].append(list(micro_batches[k]))
            load[rank] += costs[k]
        for rank in ranks[len(round_) :]:
            plan[rank].append([])
    return plan


def plan_step(
    prompt_lens: Sequence[int],
    response_lens: Sequence[int],
    max_tokens: int,
    num_ranks: int = 1,
    *,
    padded: bool = True,
) -> list[list[list[int]]]:
    """`[rank][k]`: row indices of the k-th micro-batch each rank trains in this step.

    Every rank gets the same number of micro-batches (some possibly empty), each within
    `max_tokens`; together they hold every row exactly once."""
    micro_batches = split_by_token_budget(prompt_lens, response_lens, max_tokens, padded=padded)
    costs = [
        micro_batch_cost(prompt_lens, response_lens, mb, padded=padded) for mb in micro_batches
    ]
    return deal_to_ranks(micro_batches, costs, num_ranks)


def padding_free_logprobs(
    model,
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    temperature: float = 1.0,
    *,
    with_entropy: bool = False,
):
    """Log-probs `[B, R]` of each response token (zeros past a response's end), computed on the
    rows packed without padding; same values and layout as `response_logprobs` on `pack(...)`.

    Needs a model whose attention masks follow position-id restarts (Transformers' standard
    causal-mask path does; models with multi-dimensional positions such as Qwen-VL do not)."""
    seqs = [
        np.concatenate([np.asarray(p, np.int64), np.asarray(r, np.int64)])
        for p, r in zip(prompts, responses, strict=True)
    ]
    device = next(model.parameters()).device
    input_ids = torch.from_numpy(np.concatenate(seqs)).unsqueeze(0).to(device)
    position_ids = torch.cat([torch.arange(len(s)) for s in seqs]).unsqueeze(0).to(device)
    logits = model(
        input_ids=input_ids, attention_mask=None, position_ids=position_ids, use_cache=False
    ).logits
    width_r = max(max((len(r) for r in responses), default=0), 1)
    # Response token j of row i sits at flat column start_i + len(prompt_i) + j and is predicted
    # by the logits one column earlier; columns past the response's end are masked below.
    starts = np.cumsum([0] + [len(s) for s in seqs[:-1]])
    first = torch.tensor(
        [int(st) + len(p) - 1 for st, p in zip(starts, prompts, strict=True)], device=device
    )
    lengths_b = torch.tensor([len(r) for r in responses], device=device)
    columns_r = torch.arange(width_r, device=device)
    mask_br = (columns_r < lengths_b.unsqueeze(1)).float()
    columns_br = (first.unsqueeze(1) + columns_r).clamp(max=input_ids.shape[1] - 1)
    logits_brv = logits[0][columns_br].float()
    if temperature > 0:
        logits_brv = logits_brv / temperature
    logp_brv = torch.log_softmax(logits_brv, dim=-1)
    targets_br = input_ids[0][(columns_br + 1).clamp(max=input_ids.shape[1] - 1)]
    logp_br = logp_brv.gather(-1, targets_br.unsqueeze(-1)).squeeze(-1) * mask_br
    if not with_entropy:
        return logp_br
    entropy_br = -(logp_brv.exp() * logp_brv).sum(-1) * mask_br
    return logp_br, entropy_br
