"""The base of every configuration section: unknown keys are errors, assignments are validated,
and each field's docstring is its description (what `flywheel config --reference` prints)."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)
