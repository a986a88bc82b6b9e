"""The C flat-JSONL scan against the reference reading: json.loads, then as_int/as_float/as_str/as_bool.

The scan may say "not clean" (None) for anything, but when it answers, every value must be the
reference's; and when the reference fails on any line, the scan must say None.
"""

from __future__ import annotations

import gc
import importlib.util
import itertools
import json
import math
import shutil
import struct
import subprocess
import sys
import sysconfig
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtune.ingest.flatscan import BOOL, FLOAT, INT, LABEL, available, scan_block
from kvtune.ingest.schemas._base import as_bool
from kvtune.ingest.schemas._fields import RowError, as_float, as_int, as_str, dig

SOURCE = Path(__file__).resolve().parents[2] / "kvtune" / "ingest" / "_flatscan.c"
COMPILER = shutil.which("cc") or shutil.which("gcc")
# With a compiler the extension must be there (the install builds it); without one, nothing to test.
pytestmark = pytest.mark.skipif(
    not available() and COMPILER is None, reason="no C compiler: kvtune installs without the extension"
)
WANTED = {"n": INT, "f": FLOAT, "s": LABEL, "b": BOOL}
DTYPES = {INT: "int64", FLOAT: "float64", LABEL: "int32", BOOL: "bool"}
KEYS, KINDS = list(WANTED), list(WANTED.values())


# --- the reference --------------------------------------------------------------------------


def convert(kind: int, value, key: str):
    if kind == INT:
        return as_int(value, key, tokens=False)  # the scan returns negative counts; the caller reports them
    if kind == FLOAT:
        return as_float(value, key)
    if kind == LABEL:
        return as_str(value, key)
    return as_bool(value, key)


def reference(block: bytes, keys, kinds) -> list[tuple[int, list]] | None:
    """(line index, values) per record as the Python reading gives them; None if any line fails."""
    records = []
    for index, line in enumerate(block.split(b"\n")):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            if not isinstance(record, dict):
                return None
            records.append((index, [convert(kind, dig(record, key), key) for key, kind in zip(keys, kinds, strict=True)]))
        except (ValueError, RecursionError, RowError, OverflowError):  # as_float(10**400) overflows
            return None
    return records


def same_value(kind: int, got, want) -> bool:
    if kind == FLOAT:  # bit for bit: -0.0 is not 0.0
        return struct.pack("<d", got) == struct.pack("<d", want)
    return got == want and type(got) is type(want)


def check(block: bytes, keys=KEYS, kinds=KINDS):
    """The scan of block, after checking it against the reference wherever it answers."""
    got = scan_block(block, keys, kinds)
    want = reference(block, keys, kinds)
    if want is None:
        assert got is None, "the reference fails on this block"
    if got is None:
        return None
    assert got.lines == block.count(b"\n") + (not block.endswith(b"\n") and len(block) > 0)
    assert got.rows == len(want)
    lines = [index for index, _ in want]
    if got.record_lines is None:
        assert lines == list(range(got.rows))
    else:
        assert got.record_lines.dtype == "int64" and got.record_lines.tolist() == lines
        assert lines != list(range(got.lines))
    for k, kind in enumerate(kinds):
        wanted = [row[k] for _, row in want]
        if got.columns[k] is None:  # the key is in no record
            assert all(w is None for w in wanted) and got.vocabs[k] in (None, [])
            continue
        values, valid = got.columns[k]
        assert len(values) == got.rows and values.dtype == DTYPES[kind]
        assert valid is None or valid.dtype == "bool"
        assert (valid is None) == all(w is not None for w in wanted)
        if kind == LABEL:
            assert got.vocabs[k] == list(dict.fromkeys(w for w in wanted if w is not None))
        for row, w in enumerate(wanted):
            if w is None:
                assert not valid[row] and values[row] == 0
                continue
            assert valid is None or valid[row]
            value = got.vocabs[k][values[row]] if kind == LABEL else values[row].item()
            assert same_value(kind, value, w), (row, value, w)
    return got


def one(line: bytes, key: str, kind: int):
    """The value of key in a one-line block: None when invalid; 'not clean' when the scan says so."""
    got = check(line, [key], [kind])
    if got is None:
        return "not clean"
    if got.columns[0] is None:
        return None
    values, valid = got.columns[0]
    if valid is not None and not valid[0]:
        return None
    return got.vocabs[0][values[0]] if kind == LABEL else values[0].item()


# --- the build ------------------------------------------------------------------------------


def test_extension_is_built():
    assert available(), "a C compiler exists but kvtune.ingest._flatscan was not built: pip install -e ."


# --- hand cases -----------------------------------------------------------------------------

NOT_JSON = [
    b"[1, 2]",
    b'"text"',
    b"12",
    b"null",
    b'{"n": 1',
    b'{"n": 1}}',
    b'{"n": 1,}',
    b"{,}",
    b'{"n" 1}',
    b'{"n": 1 "f": 2}',
    b"{n: 1}",
    b"{'n': 1}",
    b'{"n": 01}',
    b'{"n": 1.}',
    b'{"n": .5}',
    b'{"n": +1}',
    b'{"n": 1e}',
    b'{"n": 1e+}',
    b'{"n": -}',
    b'{"n": 0x10}',
    b'{"x": tru}',
    b'{"x": True}',
    b'{"x": nul}',
    b'{"x": [1, 2,]}',
    b'{"x": "a\x01b"}',
    b'{"x": "a\tb"}',
    b'{"x": "a\x7f\x00"}',
    b'{"x": "\xff"}',
    b'{"x": "\xc3"}',
    b'{"x": "\xc0\xaf"}',
    b'{"x": "\xe0\x80\xaf"}',
    b'{"x": "\xf4\x90\x80\x80"}',
    b'{"x": "\\x41"}',
    b'{"x": "\\u12G4"}',
    b'{"x": "\\u12"}',
    b'{"n": 1} x',
    b'{"n": 1}\x00',
    b'\x00{"n": 1}',
    b'\x0b{"n": 1}',
    b'{"n": 1}\x0c',
    b'{"n": 1\xc2\xa0}',
    b'{"n": 1}\xef\xbb\xbf',
]

# The reference reads these (for the key n or not at all), but the scan leaves them to it.
CONSERVATIVE = [
    b'\xef\xbb\xbf{"n": 1}',  # a UTF-8 BOM
    b'{"x": NaN, "n": 1}',
    b'{"x": -Infinity, "n": 1}',
    b'{"x": "\xed\xa0\x80", "n": 1}',  # an encoded surrogate: json decodes with "surrogatepass"
    b'{"x": ' + b"[" * 70 + b"]" * 70 + b', "n": 1}',  # deeper than 64
    b'{"x": 1' + b"0" * 120 + b', "n": 1}',  # a number longer than 100 characters
    b'{"n": 1, "n": 2}',  # Python keeps the last
    b'{"\\u006e": 1}',  # an escaped key could be a wanted one
    b'{"x\\"y": 1, "n": 1}',
    b'{"n": 12.0}',
    b'{"n": "12"}',
    b'{"n": 1e3}',
    b'{"n": 1234567890123456789}',  # 19 digits
    b'{"f": "1.5"}',
    b'{"s": 12}',
    b'{"s": "a\\nb"}',
    b'{"s": "\\u0041"}',
    b'{"b": 1}',
    b'{"b": "true"}',
]


@pytest.mark.parametrize("line", NOT_JSON + CONSERVATIVE)
def test_not_clean(line):
    assert check(line) is None
    assert check(b'{"n": 1}\n' + line + b'\n{"n": 2}\n') is None


@pytest.mark.parametrize(
    "line, key, kind",
    [
        (b'{"n": true}', "n", INT),
        (b'{"n": {}}', "n", INT),
        (b'{"n": [1]}', "n", INT),
        (b'{"n": "x"}', "n", INT),
        (b'{"f": 1e400}', "f", FLOAT),
        (b'{"f": -1e400}', "f", FLOAT),
        (b'{"f": 1' + b"0" * 100 + b"}", "f", FLOAT),  # 1e100 fits a double, but over 100 characters
        (b'{"f": true}', "f", FLOAT),
        (b'{"f": []}', "f", FLOAT),
        (b'{"s": true}', "s", LABEL),
        (b'{"s": {"a": 1}}', "s", LABEL),
        (b'{"s": 1.5}', "s", LABEL),
        (b'{"b": 0}', "b", BOOL),
        (b'{"b": "false"}', "b", BOOL),
        (b'{"b": [true]}', "b", BOOL),
    ],
)
def test_wrong_type_is_not_clean(line, key, kind):
    assert one(line, key, kind) == "not clean"


@pytest.mark.parametrize(
    "line, key, kind, value",
    [
        (b'{"n": 732}', "n", INT, 732),
        (b'{"n": 0}', "n", INT, 0),
        (b'{"n": -0}', "n", INT, 0),
        (b'{"n": -5}', "n", INT, -5),  # as_int would refuse it: the caller reports negatives
        (b'{"n": 999999999999999999}', "n", INT, 999999999999999999),  # 18 digits
        (b'{"n": -999999999999999999}', "n", INT, -999999999999999999),
        (b'{"n": null}', "n", INT, None),
        (b'{"n": ""}', "n", INT, None),  # as_int("") is None
        (b'{"x": 1}', "n", INT, None),
        (b"{}", "n", INT, None),
        (b'{"f": 1.5}', "f", FLOAT, 1.5),
        (b'{"f": 0.1}', "f", FLOAT, 0.1),
        (b'{"f": 12}', "f", FLOAT, 12.0),
        (b'{"f": -0}', "f", FLOAT, 0.0),  # float(int("-0")) is +0.0
        (b'{"f": -0.0}', "f", FLOAT, -0.0),
        (b'{"f": 2.5E-3}', "f", FLOAT, 0.0025),
        (b'{"f": 1e-400}', "f", FLOAT, 0.0),
        (b'{"f": 5e-324}', "f", FLOAT, 5e-324),
        (b'{"f": 1.7976931348623157e308}', "f", FLOAT, 1.7976931348623157e308),
        (b'{"f": 9007199254740993}', "f", FLOAT, float(9007199254740993)),
        (b'{"f": 123456789012345678901234567890}', "f", FLOAT, float(123456789012345678901234567890)),
        (b'{"f": 0.30000000000000004441}', "f", FLOAT, 0.30000000000000004441),
        (b'{"f": null}', "f", FLOAT, None),
        (b'{"s": "stop"}', "s", LABEL, "stop"),
        (b'{"s": "/v1/chat/completions"}', "s", LABEL, "/v1/chat/completions"),
        (b'{"s": " "}', "s", LABEL, " "),
        (b'{"s": "caf\xc3\xa9 \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80"}', "s", LABEL, "café 日本 😀"),
        (b'{"s": ""}', "s", LABEL, None),
        (b'{"s": null}', "s", LABEL, None),
        (b'{"b": true}', "b", BOOL, True),
        (b'{"b": false}', "b", BOOL, False),
        (b'{"b": null}', "b", BOOL, None),
        (b'{"b": ""}', "b", BOOL, None),
    ],
)
def test_value(line, key, kind, value):
    got = one(line, key, kind)
    assert got == value and type(got) is type(value)
    if kind == FLOAT and value is not None:
        assert math.copysign(1, got) == math.copysign(1, value)


def test_other_fields_stay_clean():
    """Whatever the scan does not extract is validated, not judged: unicode, escapes, nesting, NaN-free numbers."""
    line = (
        '{"x": "ü\\n\\"\\\\\\/\\b\\f\\r\\t\\u00fc\\ud83d\\ude00\\ud800", "y": [1, -2.5e+3, true, false, null, {}], '
        '"z": {"n": 99, "s": "inner", "deep": [[[{"a": []}]]]}, "ключ": "значение", "w": 1e400, '
        '"n": 7, "s": "top"}'
    ).encode()
    got = check(line)
    assert got is not None
    assert got.columns[0][0].tolist() == [7] and got.vocabs[2] == ["top"]


def test_whitespace_around_tokens():
    got = check(b' \t{ "n" : 1 ,\t"s" :\r"a" , "x" : [ 1 , { } ] } \r\t')
    assert got is not None and got.columns[0][0].tolist() == [1] and got.vocabs[2] == ["a"]


def test_blank_lines_and_record_lines():
    block = b'\n{"n": 1}\n \t\r\n\x0b\x0c\n{"n": 2}\n  '
    got = check(block)
    assert (got.rows, got.lines) == (2, 6)
    assert got.record_lines.tolist() == [1, 4]
    assert got.columns[0][0].tolist() == [1, 2]


def test_no_blank_lines_means_no_record_lines():
    got = check(b'{"n": 1}\r\n{"n": 2}\r\n')
    assert (got.rows, got.lines, got.record_lines) == (2, 2, None)


def test_last_line_without_newline():
    got = check(b'{"n": 1}\n{"n": 2, "s": "end"}')
    assert (got.rows, got.lines) == (2, 2)
    assert got.vocabs[2] == ["end"]


def test_empty_and_blank_blocks():
    got = check(b"")
    assert (got.rows, got.lines, got.record_lines) == (0, 0, None)
    assert got.columns == [None, None, None, None]
    got = check(b"\n \n")
    assert (got.rows, got.lines) == (0, 2) and got.record_lines.tolist() == []


def test_a_key_in_no_record_is_none_and_a_late_key_zeroes_the_rows_before_it():
    got = check(b'{"n": 1}\n{"n": 2}\n{"n": 3, "s": "x"}\n{"n": 4}\n')
    assert got.columns[1] is None and got.columns[3] is None
    values, valid = got.columns[2]
    assert values.tolist() == [0, 0, 0, 0] and valid.tolist() == [False, False, True, False]
    assert got.vocabs[2] == ["x"]


def test_labels_are_interned_in_first_seen_order():
    block = b"".join(b'{"s": "%s"}\n' % s for s in (b"b", b"a", b"b", b"", b"c", b"a"))
    got = check(block)
    values, valid = got.columns[2]
    assert got.vocabs[2] == ["b", "a", "c"]
    assert values.tolist() == [0, 1, 0, 0, 2, 1] and valid.tolist() == [True, True, True, False, True, True]


def test_many_labels():
    block = b"".join(b'{"s": "label-%d"}\n' % (i % 5000) for i in range(20000))
    got = check(block)
    assert len(got.vocabs[2]) == 5000 and got.columns[2][0].max() == 4999


@pytest.mark.parametrize("offset", range(40))
def test_special_bytes_at_every_offset(offset):
    """Where a quote, a multi-byte character or a bad byte falls in the scanned words matters to the C code."""
    pad = b"a" * offset
    assert one(b'{"s": "%s\xc3\xa9"}' % pad, "s", LABEL) == pad.decode() + "é"
    assert one(b'{"s": "%s"}' % pad, "s", LABEL) == (pad.decode() or None)
    assert one(b'{"x": "%s\\u0041", "s": "k"}' % pad, "s", LABEL) == "k"
    assert one(b'{"x": "%s\x1f", "s": "k"}' % pad, "s", LABEL) == "not clean"
    assert one(b'{"x": "%s\xff", "s": "k"}' % pad, "s", LABEL) == "not clean"
    assert one(b'{"x": "%s\\q", "s": "k"}' % pad, "s", LABEL) == "not clean"
    assert one(b'{"s": "%s\\"", "n": 1}' % pad, "n", INT) == 1


def test_keys_inside_nested_values_are_not_matched():
    got = check(b'{"x": {"n": 5, "s": "in"}, "y": [{"n": 6}]}\n{"n": 1, "x": {"n": 2}}')
    values, valid = got.columns[0]
    assert valid.tolist() == [False, True] and values.tolist() == [0, 1]
    assert got.vocabs[2] == []


def test_path_like_keys():
    """dig() reads "a.b" nested when no such top-level key exists: the scan must not guess None."""
    assert one(b'{"a.b": 3}', "a.b", INT) == 3
    assert one(b'{"a": {"b": 3}}', "a.b", INT) == "not clean"
    assert one(b'{"x": 1}', "a.b", INT) == "not clean"
    assert one(b'{"a": [3]}', "a[0]", INT) == "not clean"
    assert one(b'{"": 3}', "", INT) == 3
    assert one(b'{"x": 1}', "", INT) == "not clean"  # dig(record, "") is the record itself


def test_unicode_and_odd_keys():
    assert one(b'{"cl\xc3\xa9": 4}', "clé", INT) == 4
    assert one(b'{"a b": 4}', "a b", INT) == 4
    assert one(b'{"x": 4}', 'a"b', INT) is None


def test_repeated_key_with_two_kinds():
    got = check(b'{"n": 3}\n{"n": null}', ["n", "n"], [INT, FLOAT])
    assert got.columns[0][0].tolist() == [3, 0] and got.columns[1][0].tolist() == [3.0, 0.0]
    assert check(b'{"n": 3, "n": 4}', ["n", "n"], [INT, FLOAT]) is None


def test_buffer_types():
    data = b'{"n": 1}\n{"n": 2}\n{"n": 3}\n'
    for block, values in [
        (data, [1, 2, 3]),
        (bytearray(data), [1, 2, 3]),
        (memoryview(data)[9:], [2, 3]),
        (memoryview(bytearray(data))[:-10], [1, 2]),
    ]:
        assert scan_block(block, ["n"], [INT]).columns[0][0].tolist() == values
    with pytest.raises((BufferError, TypeError)):
        scan_block(memoryview(data)[::2], ["n"], [INT])


def test_bad_arguments():
    with pytest.raises(ValueError):
        scan_block(b"{}", ["n", "f"], [INT])
    with pytest.raises(ValueError):
        scan_block(b"{}", ["n"], [7])
    with pytest.raises(ValueError):
        scan_block(b"{}", [f"k{i}" for i in range(65)], [INT] * 65)


def test_threads_agree_with_one_thread():
    blocks = [
        b"".join(b'{"n": %d, "f": %d.5, "s": "r%d", "b": %s}\n' % (i, i, i % 7, b"true" if i % 2 else b"false")
                 for i in range(j * 1000, j * 1000 + 3000))
        for j in range(16)
    ]
    serial = [scan_block(b, KEYS, KINDS) for b in blocks]
    with ThreadPoolExecutor(4) as pool:
        parallel = list(pool.map(lambda b: scan_block(b, KEYS, KINDS), blocks))
    for a, b in zip(serial, parallel, strict=True):
        assert a.vocabs == b.vocabs
        assert all((x[0] == y[0]).all() for x, y in zip(a.columns, b.columns, strict=True))


def test_no_leaks():
    """Python objects and raw allocations (vocabularies, the tail copy) are freed on every path."""
    from kvtune.ingest import _flatscan

    keys, kinds = (b"n", b"f", b"s", b"b"), bytes(KINDS)
    clean = b"".join(b'{"n": %d, "f": 0.5, "s": "v%d", "b": true}\n' % (i, i) for i in range(2000)) + b'{"s": "x"}'
    calls = [
        (clean, keys, kinds),
        (clean + b"\n{", keys, kinds),  # not clean at the very end
        (b'{"s": "a"}\n[1]\n', keys, kinds),
        (clean, keys, b"\x00\x01\x02\x09"),  # ValueError
        (clean, (b"n", "f"), b"\x00\x01"),  # ValueError
    ]

    def run():
        for args in calls:
            try:
                _flatscan.scan_block(*args)
            except ValueError:
                pass

    run()
    tracemalloc.start()
    try:
        for _ in range(3):
            run()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(30):
            run()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 20_000


# --- properties -----------------------------------------------------------------------------

LABELS = ["stop", "length", "/v1/chat/completions", "é", "日本", "😀", "a b", " "]
ODD_TEXTS = ["", "tab\there", 'q"uote', "back\\slash", "\x00", "\u2028", "\ud83d", "\udc00x"]
KEY_POOL = [*WANTED, "x", "y", "N", "s ", "é", "a", "a.b"]


@st.composite
def decimal_texts(draw) -> str:
    """Numbers around the C fast path's limits: 15-17 significant digits, powers of ten near ±22."""
    digits = str(draw(st.integers(1, 10 ** draw(st.integers(1, 30)))))
    point = draw(st.integers(0, len(digits) - 1))
    text = digits[: len(digits) - point] + ("." + digits[len(digits) - point :] if point else "")
    if draw(st.booleans()):
        exponent = draw(st.integers(-30, 30) | st.integers(-400, 400))
        sign = "+" if exponent >= 0 and draw(st.booleans()) else ""
        text += draw(st.sampled_from(["e", "E"])) + sign + str(exponent)
    return draw(st.sampled_from(["", "-"])) + text


finite_floats = st.floats(allow_nan=False, allow_infinity=False)
NUMBER_TEXT = st.one_of(
    st.from_regex(r"-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,24})?([eE][+-]?[0-9]{1,3})?", fullmatch=True),
    decimal_texts(),
    finite_floats.map(repr),
    st.builds(lambda x, n, f: format(x, f".{n}{f}"), finite_floats, st.integers(0, 20), st.sampled_from("eg")),
    st.integers(-(2**65), 2**65).map(str),
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(-(10**19), 10**19),
    st.floats(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.sampled_from(LABELS + ODD_TEXTS),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.sampled_from(KEY_POOL) | st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


# Values each kind reads exactly: the scan must then answer (and agree).
CLEAN_VALUES = {
    INT: st.integers(-(10**18) + 1, 10**18 - 1) | st.none(),
    FLOAT: st.floats(allow_nan=False, allow_infinity=False) | st.integers(-(10**30), 10**30) | st.none(),
    LABEL: st.text(st.characters(blacklist_categories=["Cs", "Cc"], blacklist_characters='"\\'), max_size=12)
    | st.sampled_from(LABELS)
    | st.none(),
    BOOL: st.booleans() | st.none(),
}


any_values = st.one_of(
    *CLEAN_VALUES.values(),
    json_values,
    # {"a": {"b": 1}}: what dig() finds for the key "a.b" when no top-level "a.b" exists
    st.dictionaries(st.sampled_from(["b", "n"]), st.one_of(*CLEAN_VALUES.values()), min_size=1, max_size=2),
)


ascii_keys = st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=4)


@st.composite
def key_texts(draw, key: str) -> str:
    """A key as JSON text, now and then with some characters escaped (it may decode to a wanted key)."""
    if draw(st.integers(0, 15)) != 7:
        return json.dumps(key, ensure_ascii=draw(st.booleans()))
    escape = draw(st.lists(st.booleans(), min_size=len(key), max_size=len(key)))
    return '"' + "".join(f"\\u{ord(c):04x}" if e else c for c, e in zip(key, escape, strict=True)) + '"'


@st.composite
def object_lines(draw, fitting: dict[str, st.SearchStrategy]) -> bytes:
    """One JSON object line, from json.dumps or written member by member (duplicate and escaped keys,
    raw number texts); the requested keys usually hold a value of their kind (`fitting`)."""
    members = draw(st.lists(st.tuples(st.sampled_from(KEY_POOL) | ascii_keys, any_values), max_size=4))
    for key, values in fitting.items():
        if draw(st.integers(0, 3)):
            members.insert(draw(st.integers(0, len(members))), (key, draw(values)))
    ensure_ascii = draw(st.booleans())
    if draw(st.booleans()):
        separators = draw(st.sampled_from([(",", ":"), (", ", ": "), (" , ", " : ")]))
        text = json.dumps(dict(members), separators=separators, ensure_ascii=ensure_ascii)
    else:
        values = [json.dumps(v, ensure_ascii=ensure_ascii) for _, v in members]
        for at in draw(st.lists(st.integers(0, len(values) - 1), max_size=2)) if values else ():
            values[at] = draw(NUMBER_TEXT)
        text = "{" + ",".join(f"{draw(key_texts(k))}:{v}" for (k, _), v in zip(members, values, strict=True)) + "}"
    pad = st.sampled_from(["", " ", "\t", "\r", " \r"])
    return (draw(pad) + text + draw(pad)).encode("utf-8", "surrogatepass")


@st.composite
def blocks(draw, lines: st.SearchStrategy[bytes]) -> bytes:
    parts = draw(st.lists(lines, min_size=1, max_size=8))
    for at in draw(st.lists(st.integers(0, len(parts)), max_size=2)):
        parts.insert(at, draw(st.sampled_from([b"", b" ", b"\t\r", b"\x0b", b"\x0c "])))
    return b"\n".join(parts) + draw(st.sampled_from([b"", b"\n"]))


@st.composite
def mutated(draw, blocks: st.SearchStrategy[bytes]) -> bytes:
    """Up to three bytes inserted, deleted or replaced, JSON's own bytes and bad UTF-8 favoured."""
    data = bytearray(draw(blocks))
    interesting = st.sampled_from(b'"\\{}[],:\n -.e0\x00\x1f\xff\xc3\xa9\x80')
    for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2, 3]))):
        at = draw(st.integers(0, len(data)))
        action = draw(st.sampled_from(["insert", "delete", "replace"]))
        byte = draw(interesting | st.integers(0, 255))
        if action == "insert":
            data.insert(at, byte)
        elif at < len(data):
            if action == "delete":
                del data[at]
            else:
                data[at] = byte
    return bytes(data)


@st.composite
def cases(draw) -> tuple[bytes, list[str], list[int]]:
    """Keys and kinds (the four wanted keys, or others in any order, repeats included), and a block."""
    pairs = list(WANTED.items())
    if draw(st.booleans()):
        kinds = st.sampled_from([INT, FLOAT, LABEL, BOOL])
        pairs = draw(st.lists(st.tuples(st.sampled_from(KEY_POOL), kinds), min_size=1, max_size=5))
    fitting = {key: CLEAN_VALUES[kind] for key, kind in pairs}
    block = draw(mutated(blocks(object_lines(fitting))))
    return block, [k for k, _ in pairs], [kind for _, kind in pairs]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=cases())
def test_agrees_with_reference(case):
    check(*case)


@st.composite
def clean_lines(draw) -> bytes:
    record = {key: draw(CLEAN_VALUES[kind]) for key, kind in WANTED.items() if draw(st.integers(0, 4))}
    others = draw(st.dictionaries(st.sampled_from(["x", "y", "z", "ü"]), json_values.filter(_finite), max_size=3))
    record = {**others, **record}
    items = draw(st.permutations(list(record.items())))
    separators = draw(st.sampled_from([(",", ":"), (", ", ": ")]))
    return json.dumps(dict(items), separators=separators, ensure_ascii=False).encode("utf-8", "surrogatepass")


def _finite(value) -> bool:
    """No NaN/Infinity and no surrogates: what the scan leaves to Python even in other fields."""
    text = json.dumps(value, ensure_ascii=False)
    return "NaN" not in text and "Infinity" not in text and not any("\ud800" <= c <= "\udfff" for c in text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(clean_lines(), max_size=8), end=st.sampled_from([b"", b"\n", b"\r\n"]))
def test_clean_blocks_are_scanned(lines, end):
    block = b"\n".join(lines) + end
    assert check(block) is not None


@settings(max_examples=300, deadline=None)
@given(text=NUMBER_TEXT)
def test_numbers_read_like_python(text):
    line = b'{"f": %s, "n": %s}' % (text.encode(), text.encode())
    f = one(line, "f", FLOAT)
    if math.isfinite(float(text)) and len(text) <= 100:
        assert f != "not clean"
    n = one(line, "n", INT)
    if "." not in text and "e" not in text.lower() and len(text.lstrip("-")) <= 18:
        assert n == int(text)


# --- the portable (non-SSE2) build ------------------------------------------------------------


@pytest.fixture(scope="module")
def portable(tmp_path_factory):
    """The extension compiled without SSE2, as on ARM: the 8-byte word scan of strings."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or sys.platform != "linux":
        pytest.skip("needs a C compiler on Linux")
    out = tmp_path_factory.mktemp("portable") / f"_flatscan{sysconfig.get_config_var('EXT_SUFFIX')}"
    include = sysconfig.get_paths()["include"]
    subprocess.run(
        [cc, "-O2", "-std=c11", "-shared", "-fPIC", "-DFLATSCAN_PORTABLE", f"-I{include}", str(SOURCE), "-o", out],
        check=True,
    )
    spec = importlib.util.spec_from_file_location("_flatscan", out)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(case=cases())
def test_portable_build_agrees(portable, case):
    from kvtune.ingest import _flatscan

    block, keys, kinds = case
    args = (block, tuple(k.encode() for k in keys), bytes(kinds))
    assert portable.scan_block(*args) == _flatscan.scan_block(*args)


def test_many_distinct_labels_scan_in_linear_time():
    """Labels that differ only in the last bytes of an 8-byte word ("/r/12345") all hashed to the
    same slot: 50k such routes took over a second instead of milliseconds. Now they scan about
    as fast as labels that differ early."""
    import time

    def seconds(fmt):
        block = b"".join(b'{"route":"' + (fmt % i).encode() + b'","output_tokens":5}\n' for i in range(50_000))
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            scanned = scan_block(block, ["route", "output_tokens"], [LABEL, INT])
            best = min(best, time.perf_counter() - start)
        assert len(scanned.vocabs[0]) == 50_000
        return best

    spread = seconds("%d/route")  # differs in the first bytes: never collided
    for fmt in ("/r/%05d", "%08d", "/v1/x/%08d"):
        assert seconds(fmt) < 20 * spread + 0.05, fmt


PLAIN_BYTES = frozenset(b for b in range(0x20, 0x7F) if b not in b'"\\')  # a label without escapes


def labels_colliding_in_the_old_hash(count: int) -> list[bytes]:
    """16-byte printable labels on which the unkeyed hash the scan used until #26 gave one 64-bit value.

    That hash was h = len*M; per 8-byte word w: h = (h ^ w)*M, h ^= h >> 32; then a bijective
    finalizer. Choose the state p = (h0 ^ w1)*M, so w1 = p*M⁻¹ ^ h0 and the second word w2 =
    p ^ (p >> 32) cancels the state to 0 for every label. The low bytes of w1 depend only on the
    low bytes of p, so p is built byte by byte keeping w1 and w2 printable.
    """
    mul, modulus = 0x9E3779B97F4A7C15, 2**64
    inverse, start = pow(mul, -1, modulus), 16 * mul % modulus

    def extend(i: int, p: int):
        if i == 8:
            yield ((p * inverse % modulus) ^ start).to_bytes(8, "little") + (p ^ p >> 32).to_bytes(8, "little")
            return
        for b in range(256) if i < 4 else sorted(PLAIN_BYTES):  # w2's high bytes are p's
            q = p | b << 8 * i
            if (q * inverse ^ start) >> 8 * i & 0xFF not in PLAIN_BYTES:
                continue
            if i >= 4 and (b ^ q >> 8 * (i - 4)) & 0xFF not in PLAIN_BYTES:  # w2's low bytes
                continue
            yield from extend(i + 1, q)

    return list(itertools.islice(extend(0, 0), count))


def test_labels_built_to_collide_scan_in_linear_time():
    """Route/model/url labels are whatever a client sends. With an unkeyed hash, 40,000 labels built
    to collide (1.9 MB of JSONL) took 2.3-3.5 s against 8 ms for random ones, quadratic in their
    count; keyed per scan, nobody can build them, and they scan as fast as random labels."""
    import random
    import time

    count = 40_000
    colliding = labels_colliding_in_the_old_hash(count)
    assert len(set(colliding)) == count and all(set(label) <= PLAIN_BYTES for label in colliding)
    alphabet = bytes(sorted(PLAIN_BYTES))
    rng = random.Random(26)
    spread = [bytes(rng.choices(alphabet, k=16)) for _ in range(count)]

    def seconds(labels):
        block = b"".join(b'{"route":"' + label + b'","output_tokens":5}\n' for label in labels)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            scanned = scan_block(block, ["route", "output_tokens"], [LABEL, INT])
            best = min(best, time.perf_counter() - start)
        assert scanned.vocabs[0] == [label.decode() for label in labels]
        return best

    random_s, colliding_s = seconds(spread), seconds(colliding)
    assert colliding_s < 5 * random_s + 0.05, (colliding_s, random_s)
