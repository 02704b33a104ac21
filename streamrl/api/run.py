"""What every role is told about its run: the config and where the run's files are.

The controller prepares it once (`runtime/context.py:prepare`: the policy directory, with the
built-in model and warm start on first use, the datasets, the run directory); every role's
builder receives it. It is small and plain, so it can be passed to Ray actors, which rebuild
their heavy objects (model, tokenizer) from it. Imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from streamrl.config.schema import Config


@dataclass
class RunContext:
    cfg: Config
    policy_dir: Path
    run_dir: Path
    train_rows: list[Any] | None
    """The training prompts, `data.dataset.PromptRow`s (None in the Ray processes of roles
    other than the feeder)."""
    eval_rows: list[Any]
    num_malformed_rows: int = 0
    checkpoint: Path | None = None
    """Checkpoint the trainer resumes from (None: a fresh start)."""
    num_overlong_prompts: int = 0
    """Rows of the data files left out: prompt + rollout.max_new_tokens beyond the context."""
    cached_tokenizer: Any = field(default=None, init=False, repr=False, compare=False)
    """The policy's tokenizer once `models.loading.policy_tokenizer` has loaded it, shared by
    every role built from this context in this process (inline and threads mode build them all
    from one). Never pickled, nor copied by `dataclasses.replace`: a context sent to another
    process, or a copy, loads its own."""

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "cached_tokenizer": None}
