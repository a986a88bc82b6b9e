"""The model each log row names, as a dimension of the logs: one deployment serves one model, so
logs that name several are one error until `--log-model NAME` selects the rows of one.

A row's model is the id the log holds for it (ingest's `model` column: the request's `model`,
LiteLLM's `model_group`, …); rows that name none do not count as a model. NAME matches a logged
id ignoring case (Hugging Face hub ids are case-insensitive, and gateways log them lowercased or
not), so ids that differ only in case are one model; it is never a substring or pattern match.
The selection happens where rows are counted (`ProfileBuilder`, in every worker process or Ray
task), and what it left out is counted beside the profile, mergeable like the rest of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtune.domain.fields import MAX_INTEGER
from kvtune.errors import InputError, OptionError

__all__ = ["ModelSelection", "same_model", "models_by_rows", "one_logged_model", "describe_models"]

#: The option that selects a model, as errors name it.
OPTION = "--log-model"
_MAX_ROWS = MAX_INTEGER  # as saved histograms bound their counts


def same_model(a: str, b: str) -> bool:
    """Whether two logged ids name one model (equal ignoring case)."""
    return a.casefold() == b.casefold()


@dataclass(frozen=True, slots=True)
class ModelSelection:
    """What `--log-model NAME` left out of a profile: rows of each other logged model, and rows
    that name no model (they cannot be said to be NAME's)."""

    name: str
    left_out: Mapping[str, int] = field(default_factory=dict)  # logged id -> rows
    unnamed_rows: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "left_out", dict(sorted(self.left_out.items())))

    def merge(self, other: ModelSelection | None) -> ModelSelection:
        """Counts add up; two selections of different models cannot be one profile."""
        if other is None:
            return self
        if not same_model(self.name, other.name):
            raise InputError(f"these profiles select different logged models ({self.name!r}, {other.name!r}) "
                             "and cannot be merged", field=OPTION)
        left_out = dict(self.left_out)
        for model, rows in other.left_out.items():
            left_out[model] = left_out.get(model, 0) + rows
        return ModelSelection(self.name, left_out, self.unnamed_rows + other.unnamed_rows)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "left_out": dict(self.left_out), "unnamed_rows": self.unnamed_rows}

    @classmethod
    def from_dict(cls, data: Any, where: str = "log_model") -> ModelSelection:
        """A saved profile's selection; an InputError names the field that is wrong."""
        if not isinstance(data, Mapping):
            raise InputError("expected {name, left_out, unnamed_rows}", field=where)
        if not isinstance(data.get("name"), str) or not data["name"]:
            raise InputError("expected the model's id", field=f"{where}.name")
        left_out = data.get("left_out")
        if not isinstance(left_out, Mapping) or not all(isinstance(k, str) and _count(v) for k, v in left_out.items()):
            raise InputError("expected {model: rows}", field=f"{where}.left_out")
        if not _count(data.get("unnamed_rows")):
            raise InputError("expected a count of rows", field=f"{where}.unnamed_rows")
        return cls(data["name"], dict(left_out), data["unnamed_rows"])


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_ROWS


def models_by_rows(counts: Mapping[str, int]) -> dict[str, int]:
    """Rows per model, ids that differ only in case summed under the spelling with the most rows
    (ties: the first in sort order); the busiest model first."""
    groups: dict[str, dict[str, int]] = {}
    for model, rows in sorted(counts.items()):
        if rows > 0:
            groups.setdefault(model.casefold(), {})[model] = rows
    named = {max(sorted(spellings), key=spellings.__getitem__): sum(spellings.values())
             for spellings in groups.values()}
    return dict(sorted(named.items(), key=lambda item: (-item[1], item[0])))


def describe_models(counts: Mapping[str, int]) -> str:
    """`A (12,004 rows), B (8,819 rows)`, the busiest first."""
    return ", ".join(f"{model} ({rows:,} row{'s' if rows != 1 else ''})" for model, rows in counts.items())


def one_logged_model(counts: Mapping[str, int], selection: ModelSelection | None,
                     selected: str | None = None) -> str | None:
    """The one model the profiled rows name (None: no row names one), or the error that says
    why there is none: several models and no `--log-model`, or a `--log-model` no row names.

    counts: rows per logged id among the profiled rows; selection: what `--log-model` left out of
    them (None: nothing selected); selected: the NAME asked for now, which a saved profile's own
    selection (or its single model) must match."""
    named = models_by_rows(counts)
    if selected is not None:
        if selection is None and any(not same_model(m, selected) for m in named):
            raise OptionError(f"a saved profile holds the histograms of every model it was built from "
                              f"({describe_models(named)}): profile the logs with {OPTION} {selected} instead",
                              field=OPTION)
        if selection is not None and not same_model(selection.name, selected):
            raise OptionError(f"the profile was built with {OPTION} {selection.name}, not {selected}",
                              field=OPTION)
    if selection is not None and not named:
        others = models_by_rows(selection.left_out)
        found = f"the logs name {describe_models(others)}" if others else "the logs name no model"
        unnamed = (f", and {selection.unnamed_rows:,} row(s) name none" if selection.unnamed_rows else "")
        raise OptionError(f"no logged row names {selection.name!r} (matched ignoring case): {found}{unnamed}",
                          field=OPTION)
    if len(named) > 1:
        raise InputError(f"logs name {len(named)} models: {describe_models(named)}: pick one with {OPTION}")
    return next(iter(named), None)
