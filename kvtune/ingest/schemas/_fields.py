"""Reading one field out of a loose log record, with the error a user can act on.

Every adapter's per-record code goes through these helpers, so a bad value anywhere becomes a
`RowError(field, message, reason)`: the field path names where it sits in the user's file, the
reason is the short key under which skipped rows are counted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from kvtune.domain.fields import MAX_INTEGER

INT64_MAX = 2**63 - 1
#: Prompt and output counts above this are not token counts of any request: the largest integer
#: a float64 (a JSON number in most tools) holds exactly, so sums such as prompt + output stay
#: exact and far inside int64. max_tokens may be larger (clients send 2^63 - 1 for "no limit").
MAX_TOKEN_COUNT = MAX_INTEGER
#: Timestamps are seconds since 1970 (or from a trace's start) up to the end of year 9999, the
#: last time Python's datetime and every log viewer can show; anything else is not a time.
MAX_TIME_S = 253_402_300_799.0

# Reasons under which skipped rows are counted (IngestStats.skipped keys).
MALFORMED_JSON = "malformed JSON"
NOT_OBJECT = "not a JSON object"
MALFORMED_CSV = "malformed CSV row"
MISSING_OUTPUT = "missing output token count"
BAD_TOKENS = "token count not an integer"
NEGATIVE_TOKENS = "negative token count"
TOO_MANY_TOKENS = "token count too large"
BAD_TIME = "invalid timestamp"
BAD_NUMBER = "invalid number"
BAD_TEXT = "invalid text field"
BAD_STRUCTURE = "malformed record structure"
FAILED = "failed request"
NOT_GENERATION = "not a generation"
NO_TOKENIZER = "no token counts (use --tokenizer)"


class RowError(Exception):
    """A row that cannot be used: where (field path), what (message), and its skip reason."""

    def __init__(self, field: str | None, message: str, reason: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message
        self.reason = reason


_SEGMENT = re.compile(r"([^.\[\]]+)|\[(\d+)\]")


def split_path(path: str) -> list[str | int]:
    """`choices[0].finish_reason` → ["choices", 0, "finish_reason"]."""
    parts: list[str | int] = []
    for name, index in _SEGMENT.findall(path):
        parts.append(int(index) if index else name)
    return parts


def dig(record: Any, path: str) -> Any:
    """The value at a dotted path, or None when any step is absent.

    Keys that themselves contain dots (`gen_ai.usage.output_tokens` as one flat key, CSV headers)
    win over nesting: at each level the longest run of segments that is a key is taken.
    """
    if isinstance(record, Mapping) and path in record:
        return record[path]
    parts = split_path(path)
    node = record
    i = 0
    while i < len(parts):
        part = parts[i]
        if isinstance(part, int):
            if not isinstance(node, list) or part >= len(node):
                return None
            node = node[part]
            i += 1
            continue
        if not isinstance(node, Mapping):
            return None
        j = i + 1
        # extend over following name segments while the joined key exists
        key, step = part, 1
        while j < len(parts) and isinstance(parts[j], str):
            joined = ".".join(str(p) for p in parts[i : j + 1])
            if joined in node:
                key, step = joined, j + 1 - i
            j += 1
        if key not in node:
            return None
        node = node[key]
        i += step
    return node


def show(value: Any) -> str:
    """A short, one-line rendering of a bad value for an error message."""
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return '"' + text.replace("\n", "\\n").replace('"', '\\"') + '"'
    if isinstance(value, (dict, list)):
        return "an object" if isinstance(value, dict) else "a list"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def as_int(value: Any, field: str, *, tokens: bool = True) -> int | None:
    """A non-negative integer count, None when absent; integral floats and digit strings pass."""
    if value is None or value == "":
        return None
    out: int | None = None
    if isinstance(value, bool):
        out = None
    elif isinstance(value, int):
        out = value
    elif isinstance(value, float):
        if math.isfinite(value) and value.is_integer():
            out = int(value)
    elif isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"[+-]?\d+", text):
            out = int(text)
        elif re.fullmatch(r"[+-]?\d+\.0*", text):
            out = int(text.split(".")[0])
    if out is None or abs(out) > INT64_MAX:
        raise RowError(field, f"not an integer: {show(value)}", BAD_TOKENS)
    if out < 0 and tokens:
        raise RowError(field, f"negative count: {out}", NEGATIVE_TOKENS)
    return out


def as_float(value: Any, field: str) -> float | None:
    """A finite number, None when absent; numeric strings pass."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise RowError(field, f"not a number: {show(value)}", BAD_NUMBER)
    if isinstance(value, (int, float)):
        try:
            out = float(value)
        except OverflowError:  # an integer literal of more than 308 digits
            out = math.inf
    elif isinstance(value, str):
        try:
            out = float(value.strip())
        except ValueError:
            raise RowError(field, f"not a number: {show(value)}", BAD_NUMBER) from None
    else:
        raise RowError(field, f"not a number: {show(value)}", BAD_NUMBER)
    if not math.isfinite(out):
        raise RowError(field, f"not a finite number: {show(value)}", BAD_NUMBER)
    return out


def as_str(value: Any, field: str) -> str | None:
    """A label such as a route, model or finish reason; numbers are accepted as their text."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        if not is_unicode(value):  # a lone surrogate ("\\ud800" in JSON): not text any file can hold
            raise RowError(field, f"not valid Unicode: {show(value.encode('utf-8', 'backslashreplace').decode())}",
                           BAD_TEXT)
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise RowError(field, f"not a string: {show(value)}", BAD_TEXT)


def is_unicode(text: str) -> bool:
    """Whether a str is Unicode text: json.loads gives lone surrogates ("\\ud800") as they are,
    and no UTF-8 file or Arrow column can hold them."""
    if text.isascii():
        return True
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_UNIT_S = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}


def as_time(value: Any, field: str, unit: str = "s") -> float | None:
    """Seconds (epoch or trace-relative) from a number in `unit` or an ISO 8601 string."""
    if value is None or value == "":
        return None
    if isinstance(value, datetime):  # Parquet timestamp columns read row by row
        dt = value if value.tzinfo is not None else value.replace(tzinfo=UTC)
        return dt.timestamp()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            seconds = float(value) * _UNIT_S[unit]
        except OverflowError:  # an integer literal of more than 308 digits
            seconds = math.inf
        if not math.isfinite(seconds):
            raise RowError(field, f"not a time: {show(value)}", BAD_TIME)
        return seconds
    if isinstance(value, str):
        text = value.strip()
        try:
            return float(text) * _UNIT_S[unit]
        except ValueError:
            pass
        try:
            return parse_iso(text)
        except ValueError:
            raise RowError(field, f"not a time: {show(value)}", BAD_TIME) from None
    raise RowError(field, f"not a time: {show(value)}", BAD_TIME)


_FRACTION = re.compile(r"(\.\d+)")


def parse_iso(text: str) -> float:
    """ISO 8601 → epoch seconds; naive times are UTC; any number of fraction digits."""
    text = text.replace("Z", "+00:00").replace("z", "+00:00")
    match = _FRACTION.search(text)
    extra = 0.0
    if match:  # datetime keeps 6 digits; carry the rest (Azure logs 7) separately
        digits = match.group(1)[1:]
        if len(digits) > 6:
            extra = float("0." + "0" * 6 + digits[6:])
            text = text[: match.start()] + "." + digits[:6] + text[match.end() :]
    dt = datetime.fromisoformat(text)
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=UTC)
    return dt.timestamp() + extra


def text_of(value: Any) -> str | None:
    """The plain text inside a prompt or output field: a string, chat messages, content parts."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping):
        for key in ("content", "text", "parts", "message", "output", "input"):
            if key in value:
                return text_of(value[key])
        return None
    if isinstance(value, list):
        pieces = [t for t in (text_of(v) for v in value) if t]
        return "\n".join(pieces) if pieces else ""
    return None


def max_int(values: list[int | None]) -> int | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None
