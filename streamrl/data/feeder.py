"""The feeder: turns the prompt dataset into bus rows, one group of `group_size` rows per prompt.

Batch b holds prompts b*B .. b*B+B-1 of an endless, per-epoch shuffled order, so the rows of a
batch depend only on (seed, b). Sample ids are `b<batch>-p<prompt>-s<sample>`; after a resume the
feeder recreates in-flight batches with the same ids, which is how no sample is trained twice
or skipped.

Dynamic sampling may add refill rounds to a batch (`batch(b, round_index=r)`, r >= 1, group ids
`b<batch>-r<round>-p<prompt>`). Their prompts come from a second, independently shuffled order,
at a position that depends only on (b, r), so a refill round too is a function of (seed, b, r)
whatever the timing, and round 0 is the same batch with or without refills.

A vision-language policy's feeder prepares each multimodal prompt once (`MediaPreparer`: decode,
process, store) and writes the store's key into the row's `media` field. A prompt whose media
cannot be used is left out for good, counted by reason, and its place in the order goes to the
next usable prompt, so batches keep their size and stay a function of (seed, b).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from streamrl.api import fields as F
from streamrl.api.fields import group_id, group_round  # noqa: F401 - the feeder names groups
from streamrl.data.dataset import PromptRow
from streamrl.data.prompts import encode_prompt
from streamrl.media.refs import MultimodalPrompt

if TYPE_CHECKING:  # preparing media needs torch; a text policy's feeder never imports it
    from streamrl.media.prepare import MediaPreparer


class PromptFeeder:
    def __init__(
        self,
        rows: Sequence[PromptRow],
        tokenizer,
        *,
        batch_prompts: int,
        group_size: int,
        seed: int,
        max_rounds: int = 1,
        chat_template: bool = True,
        media: MediaPreparer | None = None,
    ):
        if not rows:
            raise ValueError("the training dataset is empty")
        self.rows = list(rows)
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.media = media  # a vision-language policy's: every row then gets a `media` field
        self._prompt_ids: dict[int, np.ndarray] = {}  # encoded on first use
        self._media: dict[int, dict[str, str] | None] = {}
        self._unusable: set[int] = set()  # rows whose media failed
        self.batch_prompts = batch_prompts
        self.group_size = group_size
        self.seed = seed
        self.max_rounds = max_rounds
        self._orders: dict[tuple[str, int], list[int]] = {}

    def _prompt_index(self, position: int, stream: str = "epoch") -> int:
        """Dataset index at `position` of an endless order reshuffled every epoch. `stream` names
        the order: "epoch" for the feeder's batches, "refill" for dynamic sampling's refills."""
        epoch, offset = divmod(position, len(self.rows))
        key = (stream, epoch)
        if key not in self._orders:
            order = list(range(len(self.rows)))
            random.Random(f"{self.seed}-{stream}-{epoch}").shuffle(order)
            if len(self._orders) >= 4:  # two streams, each around one epoch boundary
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = order
        return self._orders[key][offset]

    def group_ids(self, batch_index: int, round_index: int = 0) -> list[str]:
        """Group ids of round `round_index` of batch `batch_index`, in prompt order."""
        return [group_id(batch_index, j, round_index) for j in range(self.batch_prompts)]

    def prompts(self, batch_index: int, round_index: int = 0) -> list[int]:
        """Dataset indices of the prompts of batch `batch_index` (round `round_index`), each
        encoded (its media prepared and stored): what `batch` puts on the bus. Calling it ahead
        of `batch` does the encoding then, so that `batch` itself is quick."""
        if not 0 <= round_index < self.max_rounds:
            raise ValueError(
                f"round {round_index} is outside 0 .. {self.max_rounds - 1} (max_rounds)"
            )
        out = []
        for j in range(self.batch_prompts):
            if round_index == 0:
                position, stream = batch_index * self.batch_prompts + j, "epoch"
            else:
                slot = batch_index * (self.max_rounds - 1) + round_index - 1
                position, stream = slot * self.batch_prompts + j, "refill"
            idx = self._prompt_index(position, stream)
            skipped = 0
            while not self._encode(idx):  # unusable media: the next prompt of the order
                skipped += 1
                if skipped >= len(self.rows):
                    raise ValueError("no prompt of the training data has usable media")
                idx = self._prompt_index(position + skipped, stream)
            out.append(idx)
        return out

    def batch(self, batch_index: int, round_index: int = 0) -> list[dict[str, Any]]:
        """Bus rows (see `Bus.add_rows`) for every sample of batch `batch_index` (round 0) or of
        its refill round `round_index` (1 .. max_rounds - 1)."""
        out = []
        for j, idx in enumerate(self.prompts(batch_index, round_index)):
            row = self.rows[idx]
            gid = group_id(batch_index, j, round_index)
            fields = {F.PROMPT_IDS: self._prompt_ids[idx], F.ANSWER: row.answer, F.EXTRA: row.extra}
            if self.media is not None:
                fields[F.MEDIA] = self._media[idx]
            for k in range(self.group_size):
                out.append(
                    {
                        "sample_id": f"{gid}-s{k}",
                        "group_id": gid,
                        "group_size": self.group_size,
                        "batch_index": batch_index,
                        "fields": dict(fields),
                    }
                )
        return out

    def _encode(self, idx: int) -> bool:
        """Encode row `idx` on first use (and prepare its media); False if its media failed."""
        if idx in self._prompt_ids:
            return True
        if idx in self._unusable:
            return False
        row = self.rows[idx]
        if not row.media:
            ids = encode_prompt(self.tokenizer, row.prompt, chat_template=self.chat_template)
            self._prompt_ids[idx] = np.asarray(ids, dtype=np.int64)
            self._media[idx] = None
            return True
        if self.media is None:
            raise ValueError(
                "a training prompt has images, videos or audio, but the policy takes text only"
            )
        prepared = self.media.prepare(
            MultimodalPrompt(row.prompt, row.media), f"training prompt {idx} ({row.origin})"
        )
        if prepared is None:
            self._unusable.add(idx)
            return False
        self._prompt_ids[idx] = prepared.prompt_ids
        self._media[idx] = self.media.bus_value(prepared)
        return True
