"""The vocabulary every kiln config is built from: the base model, the numeric ranges fields
declare, and the marks that say how a field enters a step's version (identity, a setting, files
by content, identity only when set). The engine reads the marks (tasks/engine/versioning.py);
stages and `training/` declare their configs with them.

It lives in the engine because versions are the engine's contract, and it imports nothing but
pydantic, so `training/` (which must import no Prefect) can use it on a bare JAX machine.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field


class ConfigModel(BaseModel):
    """Base of every config: frozen, strict about unknown fields, and hashable into a version.
    No float may be NaN or infinite (a version cannot hash one, and no stage means one)."""

    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)


# The ranges numeric config fields declare, so a wrong value is an error naming its field when
# the config is loaded, not a crash (or a silently useless run) minutes later. The reference
# (docs/configuration.md) prints each field's range.
Count = Annotated[int, Field(ge=1)]  # sizes, steps, intervals, workers: at least one
NonNegative = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=0, lt=2**31)]  # what every RNG kiln seeds (numpy, JAX, fastText) takes
Positive = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]
OpenFraction = Annotated[float, Field(gt=0, le=1)]  # (0, 1]: a share that cannot be empty
HalfOpenFraction = Annotated[float, Field(ge=0, lt=1)]  # [0, 1): a share that cannot be everything
Beta = Annotated[float, Field(ge=0, lt=1)]  # Adam's moment decay rates


def setting(default: Any = ..., **kwargs: Any) -> Any:
    """A field that cannot change the bytes of the output (worker count, log interval, addresses).

    It is left out of the step version, so changing it never reruns anything.
    """
    extra = dict(kwargs.pop("json_schema_extra", None) or {})
    extra["identity"] = False
    return Field(default, json_schema_extra=extra, **kwargs)


def files(default: Any = ..., **kwargs: Any) -> Any:
    """A field whose strings name files or folders (paths or globs) that a stage reads.

    It enters the step version by the content of what it names (tasks/engine/versioning.py
    `content_identity`), never by the path: an edited file reruns what reads it, the same file
    at another path is a cache hit. A string that names no file (an lm-eval task from lm-eval's
    own registry, say) enters as it is.
    """
    extra = dict(kwargs.pop("json_schema_extra", None) or {})
    extra["files"] = True
    return Field(default, json_schema_extra=extra, **kwargs)


def identity_when_set(default: Any = ..., **kwargs: Any) -> Any:
    """An identity field added to a stage after its versions were in use: it enters the version
    only when it differs from `default`, so configs that leave it out keep the versions (and the
    outputs in every store) they had."""
    extra = dict(kwargs.pop("json_schema_extra", None) or {})
    extra["when_set"] = True
    return Field(default, json_schema_extra=extra, **kwargs)


def left_out_at_default(model: type[BaseModel], name: str, value: Any) -> bool:
    """Whether an `identity_when_set` field holds its default, and so stays out of the version."""
    field = model.model_fields[name]
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("when_set") is True and value == field.default


def names_files(model: type[BaseModel], name: str) -> bool:
    extra = model.model_fields[name].json_schema_extra
    return isinstance(extra, dict) and extra.get("files") is True


def is_identity(model: type[BaseModel], name: str) -> bool:
    extra = model.model_fields[name].json_schema_extra
    return not (isinstance(extra, dict) and extra.get("identity") is False)
