"""Shared building blocks of the spec schema: the frozen base model and small validated field types."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, PlainSerializer, PlainValidator
from pydantic_core import PydanticCustomError

from tessera.grammar.numerics import NumericType, NumericTypeError, parse


class Section(BaseModel):
    """Base of every spec section: frozen, closed (unknown keys are errors), strict types, finite numbers."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, allow_inf_nan=False,
                              validate_default=False)


def fail(kind: str, message: str, *, at: tuple = (), offset: int | None = None, length: int = 1,
         hint: str | None = None) -> PydanticCustomError:
    """A validation error whose position the spec layer refines: `at` is a sub-path below the field,
    `offset`/`length` a character range inside a string value; `hint` a fix-it."""
    ctx: dict[str, Any] = {"message": message, "at": list(at), "length": length, "hint": hint or ""}
    if offset is not None:
        ctx["offset"] = offset
    return PydanticCustomError(kind, "{message}", ctx)


def _numeric(value: Any) -> NumericType:
    if isinstance(value, NumericType):
        return value
    if not isinstance(value, str):
        raise fail("numeric_type", "expected a numeric type such as `bf16` or `bf16 @accum(fp32)`")
    try:
        return parse(value)
    except NumericTypeError as exc:
        raise fail("numeric_type", exc.message, offset=exc.offset, length=exc.length, hint=exc.hint) from None


# A numeric-type expression (tessera.grammar.numerics); printed back as its canonical text.
Numeric = Annotated[NumericType, PlainValidator(_numeric), PlainSerializer(str, return_type=str)]


def _file_path(value: Any) -> Path:
    if isinstance(value, Path):
        return value
    if not isinstance(value, str) or not value:
        raise fail("path_type", "expected a file path (a string)")
    return Path(value)


# A path; relative paths were already made absolute by the loader (against the file that wrote them).
FilePath = Annotated[Path, PlainValidator(_file_path), PlainSerializer(str, return_type=str)]


def _token_ids(value: Any) -> list[int]:
    if not isinstance(value, list) or not value:
        raise fail("token_ids", "expected a non-empty list of token ids")
    for i, tok in enumerate(value):
        if isinstance(tok, bool) or not isinstance(tok, int) or tok < 0:
            raise fail("token_ids", f"token ids are integers >= 0, got `{tok}`", at=(i,))
    return list(value)


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, str):
        if not value:
            raise fail("prompt", "a prompt may not be empty")
        return value
    if isinstance(value, list):
        return _token_ids(value)
    raise fail("prompt", "a prompt is a string or a list of token ids")


# A prompt: text (encoded by the task's tokenizer) or a list of token ids.
Prompt = Annotated[Any, PlainValidator(_prompt)]
TokenIds = Annotated[list[int], PlainValidator(_token_ids)]

_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")


def _name(value: Any) -> str:
    if not isinstance(value, str) or not _NAME.match(value):
        raise fail("name", "a name is letters, digits, `_`, `-` and `.` (it names the run directory)")
    return value


Name = Annotated[str, PlainValidator(_name)]

