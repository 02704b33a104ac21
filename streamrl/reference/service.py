"""The reference role: log-probs of each response under the frozen initial policy (for the KL term).

Started only when `algorithm.kl.coef > 0`. It claims rows as soon as their responses are written,
scores them with the same packing and log-prob code as the trainer (so the KL is computed on
identically laid-out numbers), and writes `ref_logprobs`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from streamrl.api import fields as F
from streamrl.bus.transform import TransformRole
from streamrl.media.prepare import row_media
from streamrl.trainer.logprobs import pack, response_logprobs

CONSUMER = "reference"


@torch.no_grad()
def reference_fields(
    model, rows: Sequence[Mapping[str, Any]], *, pad_token_id: int, temperature: float
) -> dict[str, dict[str, Any]]:
    routes = [r[F.ROUTED_EXPERTS] for r in rows] if F.ROUTED_EXPERTS in rows[0] else None
    prompts, responses = [r[F.PROMPT_IDS] for r in rows], [r[F.RESPONSE_IDS] for r in rows]
    batch = pack(prompts, responses, pad_token_id, routes, row_media(rows))
    logp_br = response_logprobs(model, batch.to(next(model.parameters()).device), temperature)
    logp_br = logp_br.cpu()
    return {
        r["sample_id"]: {
            F.REF_LOGPROBS: logp_br[i, : len(r[F.RESPONSE_IDS])].numpy().astype(np.float32)
        }
        for i, r in enumerate(rows)
    }


class ReferenceRole(TransformRole):
    consumer = CONSUMER
    consumes = (F.PROMPT_IDS, F.RESPONSE_IDS)

    def __init__(
        self,
        bus,
        model,
        *,
        pad_token_id: int,
        temperature: float,
        max_rows: int,
        lease_s: float,
        routing_replay: bool = False,
        multimodal: bool = False,
    ):
        super().__init__(bus, max_rows=max_rows, lease_s=lease_s)
        if routing_replay:  # the rollout's experts, replayed in this forward too
            self.consumes = (*self.consumes, F.ROUTED_EXPERTS)
        if multimodal:  # a vision-language policy: the prompts' media
            self.consumes = (*self.consumes, F.MEDIA)
        self.model = model.eval()
        self.pad_token_id = pad_token_id
        self.temperature = temperature

    def compute(self, rows):
        return reference_fields(
            self.model, rows, pad_token_id=self.pad_token_id, temperature=self.temperature
        )


LOGP_CONSUMER = "logp"


class LogpRole(ReferenceRole):
    """The pi_old role of decoupled PPO: log-probs under the newest published policy.

    Before each batch of rows it pulls newer weights from the weight-sync service, then writes
    `old_logprobs` and the version they were computed at (`old_version`). The trainer clips its
    ratio around these (the proximal policy) and corrects the gap to the rollout's log-probs
    (the behaviour policy) with the importance weight.
    """

    consumer = LOGP_CONSUMER

    def __init__(self, bus, weights, model, **kwargs):
        super().__init__(bus, model, **kwargs)
        self.weights = weights
        self.version = -1

    def pull_weights(self) -> None:
        newer = self.weights.fetch_newer(self.version)
        if newer is not None:
            version, tensors = newer
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, value in tensors.items():
                    params[name].copy_(torch.as_tensor(value))  # copied: any dtype, bf16 too
            self.version = version

    def compute(self, rows):
        self.pull_weights()
        out = reference_fields(
            self.model, rows, pad_token_id=self.pad_token_id, temperature=self.temperature
        )
        return {
            sample_id: {F.OLD_LOGPROBS: v[F.REF_LOGPROBS], F.OLD_VERSION: self.version}
            for sample_id, v in out.items()
        }
