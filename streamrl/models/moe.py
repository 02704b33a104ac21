"""Mixture-of-experts routing: what a router chooses, recording it, and replaying given choices.

A Qwen3-MoE layer's router scores its experts (`logits = h @ W_r.T`), keeps the top k of
softmax(logits) and, with `norm_topk_prob`, renormalises their probabilities to sum to 1; the
layer's output is the chosen experts' outputs weighted by those. `route` is that math, with the
option of using given experts instead of the top k: their weights are still the router's
probabilities of them, so the router keeps its gradient (rollout routing replay, R3). The
builtin engine routes with `route` itself; a transformers model is tapped with forward hooks on
its routers (`RouterTaps`), which record each forward's logits and experts (`recording`) and,
inside `replaying`, put the given experts in place of the router's own.

Routes travel as the sample field `routed_experts`: uint8 `[positions, moe layers, k]` for the
prompt and response positions the engine ran (every one but the last token's), the experts of
each position in the order the engine ranked them (`ROUTE_DTYPE`).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

ROUTE_DTYPE = np.uint8  # routes on the bus: expert ids below MAX_EXPERTS
MAX_EXPERTS = 256
NO_ROUTE = -1  # a position without given experts: the router chooses


def check_routable(num_experts: int) -> None:
    """Refuse to capture routes of a model with no MoE layer (`num_experts` 0) or with more
    experts than `ROUTE_DTYPE` holds."""
    if not num_experts:
        raise TypeError(
            "algorithm.routing_replay: the model has no mixture-of-experts layer, so there "
            "are no routing decisions to capture and replay; set algorithm.routing_replay=off"
        )
    if num_experts > MAX_EXPERTS:
        raise ValueError(
            f"algorithm.routing_replay: routes are stored as uint8 (up to {MAX_EXPERTS} experts "
            f"a layer); this model has {num_experts}"
        )


def route(
    logits_ne: torch.Tensor,
    top_k: int,
    normalise: bool,
    forced_nk: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights [N, k] in the logits' dtype, experts [N, k], the router's own top k [N, k]) of
    router logits [N, E]. Rows of `forced_nk` other than `NO_ROUTE` replace the router's choice;
    their weights are the router's probabilities of those experts (renormalised when
    `normalise`), so gradients reach the router either way."""
    probs_ne = torch.softmax(logits_ne, dim=-1, dtype=torch.float32)
    top_nk, native_nk = torch.topk(probs_ne, top_k, dim=-1)
    experts_nk = native_nk
    if forced_nk is not None:
        given = (forced_nk[:, :1] != NO_ROUTE).expand_as(native_nk)
        experts_nk = torch.where(given, forced_nk.to(native_nk.dtype), native_nk)
        top_nk = probs_ne.gather(-1, experts_nk)
    if normalise:
        top_nk = top_nk / top_nk.sum(dim=-1, keepdim=True)
    return top_nk.to(logits_ne.dtype), experts_nk, native_nk


def find_routers(model) -> list[torch.nn.Module]:
    """The routers of `model` (any wrapper around a transformers MoE model), in layer order: the
    modules that pick `top_k` of `num_experts` experts with a `weight` [experts, hidden]."""
    return [
        module
        for module in model.modules()
        if all(hasattr(module, a) for a in ("top_k", "num_experts", "weight"))
        and isinstance(getattr(module, "weight", None), torch.Tensor)
        and module.weight.dim() == 2
        and module.weight.shape[0] == module.num_experts
    ]


@dataclass
class RoutingRecord:
    """What the routers of one or more forwards did: per MoE layer, each forward's router
    logits [N, E] and the experts used [N, k]; with replay, how many given (token, layer)
    decisions the router would have made the same way (as sets of experts)."""

    logits: list[list[torch.Tensor]] = field(default_factory=list)
    experts: list[list[torch.Tensor]] = field(default_factory=list)
    valid: list[torch.Tensor] = field(default_factory=list)  # per forward: real tokens [N]
    agreed: int = 0
    compared: int = 0

    def add(self, layer: int, logits_ne, experts_nk, valid_n) -> None:
        while len(self.logits) <= layer:
            self.logits.append([])
            self.experts.append([])
        self.logits[layer].append(logits_ne)
        self.experts[layer].append(experts_nk.detach())
        if layer == 0:
            ones = torch.ones(len(logits_ne), dtype=torch.bool, device=logits_ne.device)
            self.valid.append(ones if valid_n is None else valid_n.reshape(-1).bool())

    def valid_tokens(self) -> torch.Tensor:
        """[all recorded tokens]: which are real (not padding)."""
        return torch.cat(self.valid)


class RouterTaps:
    """Forward hooks on every router of a model; inert unless `record` or `forced` is set."""

    def __init__(self, routers: Sequence[torch.nn.Module]):
        self.routers = list(routers)
        self.record: RoutingRecord | None = None
        self.forced_nlk: torch.Tensor | None = None  # [tokens, layers, k]; NO_ROUTE: none given
        self.valid_n: torch.Tensor | None = None  # tokens whose decisions count in `record`
        for layer, router in enumerate(self.routers):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):
        def hook(module, inputs, output):
            if self.record is None and self.forced_nlk is None:
                return None
            logits_ne, weights_nk, experts_nk = output
            if self.forced_nlk is not None:
                forced_nk = self.forced_nlk[:, layer]
                if forced_nk.shape != experts_nk.shape:
                    raise ValueError(
                        f"routing replay: layer {layer}'s router saw {tuple(experts_nk.shape)} "
                        f"(tokens, k), the routes given are {tuple(forced_nk.shape)}"
                    )
                weights_nk, experts_nk, native_nk = route(
                    logits_ne,
                    module.top_k,
                    bool(getattr(module, "norm_topk_prob", True)),
                    forced_nk,
                )
                if self.record is not None:
                    self._compare(forced_nk, native_nk)
                output = (logits_ne, weights_nk, experts_nk)
            if self.record is not None:
                self.record.add(layer, logits_ne, experts_nk, self.valid_n)
            return output

        return hook

    def _compare(self, forced_nk, native_nk) -> None:
        given = forced_nk[:, 0] != NO_ROUTE
        if self.valid_n is not None:
            given &= self.valid_n
        same = (forced_nk.sort(-1).values == native_nk.sort(-1).values).all(-1) & given
        self.record.agreed += int(same.sum())
        self.record.compared += int(given.sum())


# Per model object (or wrapper of one): its taps, or None for a dense model. Every training
# and scoring forward asks; the module walk that answers happens once per model.
_TAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def router_taps(model) -> RouterTaps | None:
    """The taps on `model`'s routers (installed at the first call), None for a dense model.
    Wrappers of one model (compiled, autocast, LoRA) share its taps: they hang on its first
    router."""
    if model in _TAPS:
        return _TAPS[model]
    routers = find_routers(model)
    taps = getattr(routers[0], "_streamrl_taps", None) if routers else None
    if routers and taps is None:
        taps = RouterTaps(routers)
        routers[0]._streamrl_taps = taps
    _TAPS[model] = taps
    return taps


@contextlib.contextmanager
def recording(model) -> Iterator[RoutingRecord | None]:
    """Record what `model`'s routers do inside the block (None, and nothing done, when `model`
    has no routers)."""
    taps = router_taps(model)
    if taps is None:
        yield None
        return
    record = taps.record = RoutingRecord()
    try:
        yield record
    finally:
        taps.record = None


@contextlib.contextmanager
def replaying(model, forced_nlk: torch.Tensor | None, valid_n: torch.Tensor | None = None):
    """Inside the block, `model`'s forwards route token n of layer l to experts
    `forced_nlk[n, l]` (positions with `NO_ROUTE` route themselves; None: all of them); tokens
    are the forward's flattened [batch * sequence]. `valid_n` [N] marks its real tokens (not
    padding), those a `recording` counts. A dense model with no routes: nothing to do."""
    taps = router_taps(model)
    if taps is None and forced_nlk is None:
        yield
        return
    if taps is None:
        raise TypeError(
            "algorithm.routing_replay: the rows carry routed experts, but the model has no "
            "mixture-of-experts router to replay them in"
        )
    if forced_nlk is not None and forced_nlk.shape[1] != len(taps.routers):
        raise ValueError(
            f"routing replay: the routes cover {forced_nlk.shape[1]} MoE layers, the model has "
            f"{len(taps.routers)}"
        )
    taps.forced_nlk = forced_nlk
    taps.valid_n = None if valid_n is None else valid_n.reshape(-1).bool()
    try:
        yield
    finally:
        taps.forced_nlk = taps.valid_n = None


def merge_routes(routes: np.ndarray | None, later: np.ndarray | None) -> np.ndarray | None:
    """A sequence's routes so far, updated by those of a later pass over it (a continuation
    after an in-flight update, the next turn of an episode): every position the later pass ran
    takes its routes. The tokens sampled after that pass were computed over the keys and values
    it left in the cache, so its routes are what reproduce their log-probs; the tokens before
    it came from an older version, which the importance correction accounts for anyway."""
    if routes is None or later is None:
        return later if routes is None else routes
    later = np.asarray(later)
    if len(later) >= len(routes):
        return later
    return np.concatenate([later, routes[len(later) :]])


def padded_routes(
    routes: Sequence[np.ndarray], starts: Sequence[int], width: int, num_rows: int | None = None
) -> torch.Tensor:
    """Routes laid out like a batch's tokens: [rows * width, layers, k] long, row i's routes
    from column starts[i] on, `NO_ROUTE` elsewhere. With `num_rows=None` the rows sit end to end
    in one sequence of `width` tokens (padding-free), `starts` being flat offsets."""
    first = next(r for r in routes if len(r))
    layers, k = first.shape[1:]
    rows_of_width = num_rows is not None
    total = num_rows * width if rows_of_width else width
    out = torch.full((total, layers, k), NO_ROUTE, dtype=torch.long)
    for i, (r, start) in enumerate(zip(routes, starts, strict=True)):
        offset = i * width + start if rows_of_width else start
        out[offset : offset + len(r)] = torch.from_numpy(np.asarray(r).astype(np.int64))
    return out


def load_balancing_loss(record: RoutingRecord, num_experts: int, top_k: int):
    """Switch Transformer's load-balancing loss over the recorded layers (transformers'
    `load_balancing_loss_func`, as Qwen3-MoE trains with): E * sum_e f_e * P_e, f_e the share of
    routed slots on expert e and P_e its mean router probability; 1 when balanced."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    logits = tuple(torch.cat(per_layer) for per_layer in record.logits)
    mask = record.valid_tokens().reshape(1, -1).long()
    return load_balancing_loss_func(logits, num_experts, top_k, mask)


def expert_counts(record: RoutingRecord, num_experts: int) -> list[list[float]]:
    """Per MoE layer, per expert: the real tokens routed to it (each token counts once for each
    of its k experts)."""
    valid_n = record.valid_tokens()
    return [
        torch.bincount(torch.cat(per_layer)[valid_n].reshape(-1), minlength=num_experts)
        .float()
        .tolist()
        for per_layer in record.experts
    ]
