"""The base of every config section (`streamrl.config.schema`, `streamrl.config.runtime_schema`)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """Base for every config section: unknown keys are errors, values are checked on assignment,
    and no number may be NaN or infinite (a NaN learning rate or timeout is never meant)."""

    model_config = ConfigDict(
        extra="forbid", validate_assignment=True, use_attribute_docstrings=True, allow_inf_nan=False
    )
