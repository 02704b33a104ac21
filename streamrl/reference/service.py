"""The reference role: log-probs of each response under the frozen initial policy (for the KL term).

Started only when `algorithm.kl_coef > 0`. It claims rows as soon as their responses are written,
scores them with the same packing and log-prob code as the trainer (so the KL is computed on
identically laid-out numbers), and writes `ref_logprobs`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from streamrl.api import fields as F
from streamrl.trainer.logprobs import pack, response_logprobs

CONSUMER = "reference"


@torch.no_grad()
def reference_fields(
    model, rows: Sequence[Mapping[str, Any]], *, pad_token_id: int, temperature: float
) -> dict[str, dict[str, Any]]:
    batch = pack([r[F.PROMPT_IDS] for r in rows], [r[F.RESPONSE_IDS] for r in rows], pad_token_id)
    logp_br = response_logprobs(model, batch, temperature)
    return {
        r["sample_id"]: {
            F.REF_LOGPROBS: logp_br[i, : len(r[F.RESPONSE_IDS])].numpy().astype(np.float32)
        }
        for i, r in enumerate(rows)
    }


class ReferenceRole:
    def __init__(
        self, bus, model, *, pad_token_id: int, temperature: float, max_rows: int, lease_s: float
    ):
        self.bus = bus
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.temperature = temperature
        self.max_rows = max_rows
        self.lease_s = lease_s
        self.claim_wait_s = 0.0  # set by runtimes whose bus supports long polls
        self.busy_s = 0.0

    def step(self) -> bool:
        lease = self.bus.claim(
            CONSUMER,
            [F.PROMPT_IDS, F.RESPONSE_IDS],
            self.max_rows,
            lease_s=self.lease_s,
            wait_s=self.claim_wait_s,
        )
        if lease is None:
            return False
        start = time.perf_counter()
        self.bus.write(
            reference_fields(
                self.model, lease.rows, pad_token_id=self.pad_token_id, temperature=self.temperature
            )
        )
        self.bus.ack(lease.lease_id)
        self.busy_s += time.perf_counter() - start
        return True

    def stats(self) -> dict[str, float]:
        return {"busy_s": self.busy_s}
