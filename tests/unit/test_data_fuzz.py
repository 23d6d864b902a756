"""Hypothesis over the trainers' JSONL readers (livemoe.train.data.load_jsonl, livemoe.train.live.data.load_sessions):
any line (JSON of any shape and depth, text with lone surrogates, bytes that are not UTF-8) is loaded or refused
with a DataError naming the file and line, never another exception; with skip_bad_lines every line is loaded or
skipped. Seeded: the same lines every run."""
import json
import re

import pytest

hypothesis = pytest.importorskip("hypothesis", reason="needs hypothesis (pip install -e .[test])")
from hypothesis import HealthCheck, given, seed, settings, strategies as st  # noqa: E402

from livemoe.train.data import DataError, load_jsonl  # noqa: E402
from livemoe.train.live.data import load_sessions  # noqa: E402

KEYS = st.sampled_from(["documents", "question", "answer", "history", "id", "reference", "meta", "system",
                        "intervals", "events", "decision", "kind", "recipient", "task", "message", "type", "user",
                        "text", "t", "recorded", "facts", "paragraphs", "question_decomposition"])
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=20)  # lone surrogates included
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | TEXT
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(KEYS | TEXT, inner,
                                                                                            max_size=5), max_leaves=30)
SEED_RECORD = {"documents": ["link 1: red scarf."], "question": "color?", "answer": "red"}
SESSION = {"id": "s", "system": "live room", "intervals": [
    {"events": [{"type": "comment", "user": "amy", "text": "hi"}], "decision": {"kind": "OBS"}}]}


def deep(n: int) -> str:
    return "[" * n + "]" * n


def mutate(base: dict) -> st.SearchStrategy:
    """base with fields replaced by anything (the likely shapes, broken), or deeply nested."""
    return st.one_of(
        st.builds(lambda k, v: {**base, k: v}, KEYS, VALUES).map(lambda d: json.dumps(d, allow_nan=True)),
        st.sampled_from([50, 127, 129, 1200, 5000]).map(lambda n: json.dumps(base)[:-1] + f', "meta": {deep(n)}}}'),
        VALUES.map(lambda v: json.dumps(v, allow_nan=True)),
    )


LINES = st.lists(st.one_of(mutate(SEED_RECORD), mutate(SESSION), st.binary(max_size=30).map(
    lambda b: b.decode("latin-1"))), min_size=1, max_size=6)


def write(tmp_path, name: str, lines: list) -> str:
    path = tmp_path / name
    with open(path, "wb") as f:
        for line in lines:
            f.write(line.replace("\n", " ").encode("utf-8", "surrogatepass") + b"\n")
    return str(path)


@seed(35)
@settings(max_examples=300, derandomize=True, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=LINES)
def test_any_line_is_loaded_or_named(tmp_path, lines):
    path = write(tmp_path, "d.jsonl", lines)
    try:
        load_jsonl(path)
    except DataError as e:
        assert re.match(rf"{re.escape(path)}:\d+: ", str(e)) and "\n" not in str(e), str(e)
    records, stats = load_jsonl(path, skip_bad_lines=True)
    assert stats.loaded == len(records) and stats.loaded + len(stats.skipped) <= len(lines)
    try:
        load_sessions(path)
    except DataError as e:
        assert str(e).startswith(path) and "\n" not in str(e), str(e)
