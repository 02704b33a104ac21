"""The routed experts an SGLang server returns, as the `routed_experts` field holds them.

An SGLang server started with `--enable-return-routed-experts` answers a request that asks for
`return_routed_experts` with `meta_info.routed_experts`: base64 of the experts of every prompt
and output position but the last token's, `[positions, decoder layers, top k]`, int32 (newer
servers may send 2- or 1-byte ids). `RoutingLayout` knows the model's decoder layers, which of
them have a router, and its top k, and turns that payload into uint8 `[positions, MoE layers,
top k]`. Imported only when the SGLang engine captures routes (it needs torch, via
`streamrl.models.moe`).
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from streamrl.models.moe import ROUTE_DTYPE, check_routable
from streamrl.rollout.sglang_client import SglangError


@dataclass(frozen=True)
class RoutingLayout:
    """How a model's routed experts arrive from SGLang: `num_layers` per position (SGLang's
    capture buffer has one per decoder layer), of which `moe_layers` have a router, `top_k` experts
    each, ids below `num_experts`."""

    num_layers: int
    moe_layers: tuple[int, ...]
    top_k: int
    num_experts: int

    @classmethod
    def of(cls, model_dir: Path) -> RoutingLayout:
        """The layout of the model in `model_dir` (its config.json; a vision-language model's
        text config). Mixture-of-experts layers: Qwen-MoE's `mlp_only_layers` and
        `decoder_sparse_step`, DeepSeek's `first_k_dense_replace` and `moe_layer_freq`."""
        path = model_dir / "config.json"
        if not path.is_file():
            raise ValueError(
                f"routing capture reads the model's layers from its config.json, and "
                f"{str(model_dir)!r} has none: give the SGLang engine a local model directory"
            )
        config = json.loads(path.read_text())
        config = config.get("text_config") or config.get("thinker_config", {}).get(
            "text_config", config
        )
        num_experts = int(
            config.get("num_experts")  # as transformers 4 writes it; 5 writes num_local_experts
            or config.get("num_local_experts")
            or config.get("n_routed_experts")  # DeepSeek
            or 0
        )
        check_routable(num_experts)
        num_layers = int(config["num_hidden_layers"])
        dense = set(config.get("mlp_only_layers") or [])
        step = int(config.get("decoder_sparse_step") or 1)
        first_moe = int(config.get("first_k_dense_replace") or 0)
        freq = int(config.get("moe_layer_freq") or 1)
        moe_layers = tuple(
            i
            for i in range(num_layers)
            if i not in dense and (i + 1) % step == 0 and i >= first_moe and i % freq == 0
        )
        return cls(num_layers, moe_layers, int(config["num_experts_per_tok"]), num_experts)

    def decode(self, encoded: Any, positions: int, url: str) -> np.ndarray:
        """`meta_info.routed_experts` of a response that ran `positions` positions, as the
        `routed_experts` field takes it: uint8 `[positions, MoE layers, top k]`."""
        if not isinstance(encoded, str):
            raise SglangError(
                f"the SGLang server at {url} sent no routed experts (meta_info.routed_experts); "
                "routing replay needs a server started with --enable-return-routed-experts"
            )
        raw = base64.b64decode(encoded)
        slots = positions * self.num_layers * self.top_k
        width = len(raw) // max(slots, 1)
        dtypes = {4: np.int32, 2: np.uint16, 1: np.uint8}
        if len(raw) != slots * width or (slots and width not in dtypes):
            raise SglangError(
                f"SGLang's routed experts are {len(raw)} bytes; expected {positions} positions x "
                f"{self.num_layers} layers x top {self.top_k} of 4, 2 or 1 bytes each"
            )
        routes = np.frombuffer(raw, dtypes.get(width, np.uint8)).reshape(
            positions, self.num_layers, self.top_k
        )[:, list(self.moe_layers)]
        if routes.size and not (0 <= int(routes.min()) and int(routes.max()) < self.num_experts):
            raise SglangError(
                f"SGLang's routed experts name experts outside [0, {self.num_experts}): "
                f"{int(routes.min())}..{int(routes.max())}"
            )
        return routes.astype(ROUTE_DTYPE)
