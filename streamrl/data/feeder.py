"""The feeder: turns the prompt dataset into bus rows, one group of `group_size` rows per prompt.

Batch b holds prompts b*B .. b*B+B-1 of an endless, per-epoch shuffled order, so the rows of a
batch depend only on (seed, b). Sample ids are `b<batch>-p<prompt>-s<sample>`; after a resume the
feeder recreates in-flight batches with the same ids, which is how no sample is trained twice
or skipped.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np

from streamrl.api import fields as F
from streamrl.data.dataset import PromptRow
from streamrl.data.prompts import encode_prompt


class PromptFeeder:
    def __init__(
        self,
        rows: Sequence[PromptRow],
        tokenizer,
        *,
        batch_prompts: int,
        group_size: int,
        seed: int,
    ):
        if not rows:
            raise ValueError("the training dataset is empty")
        self.rows = list(rows)
        self.tokenizer = tokenizer
        self._prompt_ids: dict[int, np.ndarray] = {}  # encoded on first use
        self.batch_prompts = batch_prompts
        self.group_size = group_size
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def _prompt_index(self, position: int) -> int:
        epoch, offset = divmod(position, len(self.rows))
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            random.Random(f"{self.seed}-epoch-{epoch}").shuffle(order)
            self._orders = {epoch: order}
        return self._orders[epoch][offset]

    def batch(self, batch_index: int) -> list[dict[str, Any]]:
        """Bus rows (see `Bus.add_rows`) for every sample of batch `batch_index`."""
        out = []
        for j in range(self.batch_prompts):
            idx = self._prompt_index(batch_index * self.batch_prompts + j)
            row = self.rows[idx]
            if idx not in self._prompt_ids:
                self._prompt_ids[idx] = np.asarray(
                    encode_prompt(self.tokenizer, row.prompt), dtype=np.int64
                )
            group_id = f"b{batch_index}-p{j}"
            for k in range(self.group_size):
                out.append(
                    {
                        "sample_id": f"{group_id}-s{k}",
                        "group_id": group_id,
                        "group_size": self.group_size,
                        "batch_index": batch_index,
                        "fields": {
                            F.PROMPT_IDS: self._prompt_ids[idx],
                            F.ANSWER: row.answer,
                            F.EXTRA: row.extra,
                        },
                    }
                )
        return out
