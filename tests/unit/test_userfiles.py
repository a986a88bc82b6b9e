"""kvtune.userfiles: the one reader of user-named files refuses what is not a bounded regular file of
strict UTF-8, strict YAML or strict JSON, in one InputError line."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtune.errors import InputError
from kvtune.userfiles import (
    brief,
    load_json,
    load_yaml,
    parse_json,
    parse_yaml,
    read_head,
    read_text,
)

BILLION_LAUGHS = """\
a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]
b: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]
c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]
d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]
e: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]
f: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]
g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]
h: &h [*g,*g,*g,*g,*g,*g,*g,*g,*g]
i: &i [*h,*h,*h,*h,*h,*h,*h,*h,*h]
"""


def test_non_regular_files_are_refused_without_blocking(non_regular_file, without_hanging):
    with pytest.raises(InputError) as info:
        without_hanging(lambda: read_text(non_regular_file, max_bytes=1024, field="--config"),
                        non_regular_file)
    assert "expected a regular file" in str(info.value)
    assert str(info.value).startswith(f"{non_regular_file}: --config: is a ")
    assert read_head(non_regular_file, 64) is None


def test_missing_and_unreadable(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        read_text(tmp_path / "absent.yaml", max_bytes=10)
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    with pytest.raises(InputError, match="cannot read"):
        read_text(loop, max_bytes=10)


def test_size_cap_is_exact_and_holds_for_files_without_a_size(tmp_path):
    path = tmp_path / "f.txt"
    path.write_text("x" * 100)
    assert read_text(path, max_bytes=100) == "x" * 100
    with pytest.raises(InputError, match="larger than 99 bytes"):
        read_text(path, max_bytes=99)
    # /proc files report size 0: the read itself is bounded
    with pytest.raises(InputError, match="larger than 10 bytes"):
        read_text("/proc/self/status", max_bytes=10)


def test_invalid_utf8_names_the_line(tmp_path):
    path = tmp_path / "g.yaml"
    path.write_bytes(b"version: 1\nupstream: \xff\n")
    with pytest.raises(InputError) as info:
        read_text(path, max_bytes=1000)
    assert info.value.line == 2 and "not UTF-8" in str(info.value)
    assert read_text(path, max_bytes=1000, errors="replace").endswith("\ufffd\n")


def test_billion_laughs_is_refused_at_the_first_anchor(tmp_path):
    path = tmp_path / "gateway.yaml"
    path.write_text(BILLION_LAUGHS)
    start = time.perf_counter()
    with pytest.raises(InputError) as info:
        load_yaml(path)
    assert time.perf_counter() - start < 1
    assert info.value.line == 1 and "anchors and aliases are not allowed" in str(info.value)


@pytest.mark.parametrize("text, line, words", [
    ("a: 1\nb: 2\na: 3\n", 3, "duplicate key 'a' (first at line 1)"),
    ("routes:\n  - name: x\n    name: y\n", 3, "duplicate key 'name'"),
    ("x: *undefined\n", 1, "anchors and aliases"),
    ("x: &only 1\n", 1, "anchors and aliases"),
    ("base: {a: 1}\nc:\n  <<: {a: 2}\n", 3, "merge keys"),
    ("n: " + "9" * 5000 + "\n", 1, "an integer of 5,000 digits"),
])
def test_yaml_refusals_name_the_line(text, line, words):
    with pytest.raises(InputError) as info:
        parse_yaml(text, path="g.yaml")
    assert info.value.line == line
    assert words in str(info.value)


@pytest.mark.parametrize("text", [
    "a: [1, 2\n", "a: 2024-13-45\n", "[" * 5000 + "]" * 5000, "{[1]: 2}\n",
    "a: !!python/object/apply:os.system [echo]\n", "a: 1\n---\nb: 2\n", 'a: "\\ud800"\n',
])
def test_bad_yaml_is_one_input_error(text):
    with pytest.raises(InputError, match="YAML"):
        parse_yaml(text, path="g.yaml")


def test_plain_yaml_still_reads():
    assert parse_yaml("a: 1\nb: [x, 'y', 2.5]\nc: {d: null}\n", path="g") == {
        "a": 1, "b": ["x", "y", 2.5], "c": {"d": None}}


@pytest.mark.parametrize("text, words", [
    ('{"a": 1, "b": {"c": 1, "c": 2}}', "duplicate key 'c'"),
    ('{"a": NaN}', "NaN is not JSON"),
    ('{"a": Infinity}', "Infinity is not JSON"),
    ('{"a": -Infinity}', "-Infinity is not JSON"),
    ('{"a": 1e400}', "out of range"),
    ('{"a": ' + "1" * 5000 + "}", "an integer of 5,000 digits"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ('{"a": ["\\ud800"]}', "lone UTF-16 surrogate"),
    ('{"a": 1', "invalid JSON: Expecting"),
])
def test_strict_json_refusals(text, words):
    with pytest.raises(InputError) as info:
        parse_json(text, path="r.json")
    assert words in str(info.value)
    assert "\n" not in str(info.value)


def test_lenient_json_keeps_nan_for_model_configs(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"a": NaN, "b": "\\ud83d\\ude00"}')
    data = load_json(path, max_bytes=100, strict=False)
    assert data["a"] != data["a"] and data["b"] == "\U0001F600"


@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(),
                    lambda inner: st.lists(inner) | st.dictionaries(st.text(), inner), max_leaves=50))
@settings(max_examples=200, deadline=None)
def test_brief_is_short_for_any_value(value):
    assert len(brief(value)) <= 80


def test_brief_never_builds_a_huge_repr():
    assert brief(10**100_000) == "<an integer of 332193 bits>"
    assert len(brief("x" * 10**7)) <= 80 and "..." in brief("x" * 10**7)
    assert brief(list(range(10**6))) == "[0, 1, 2, 3, ...]"
    assert brief("a") == "'a'"
