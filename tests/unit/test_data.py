"""JSONL loading (seed shape and MuSiQue), line-numbered errors, --skip_bad_lines, prompts."""
import json

import pytest

from livemoe.train.data import DataError, build_messages, load_jsonl, split_thought, write_jsonl
from livemoe.train.synthetic import make_rooms

MUSIQUE = {"id": "2hop__1", "paragraphs": [
    {"idx": 0, "title": "Paris", "paragraph_text": "Paris is the capital of France.", "is_supporting": True},
    {"idx": 1, "title": "Seine", "paragraph_text": "The Seine flows through Paris.", "is_supporting": True}],
    "question": "Which river flows through the capital of France?", "answer": "Seine",
    "answer_aliases": ["the Seine", "River Seine"], "answerable": True}


def write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_seed_shape_round_trip(tmp_path):
    rooms = make_rooms(5, seed=0)
    p = str(tmp_path / "rooms.jsonl")
    write_jsonl(p, rooms)
    records, stats = load_jsonl(p)
    assert stats.loaded == 5 and not stats.skipped
    assert [r["question"] for r in records] == [r["question"] for r in rooms]
    assert records[0]["meta"] == rooms[0]["meta"]


def test_plain_seed_record_gets_defaults(tmp_path):
    p = write_lines(tmp_path / "d.jsonl", [json.dumps({"documents": ["link 1: red scarf."], "question": "color?"})])
    (rec,), _ = load_jsonl(p)
    assert rec["history"] == [] and rec["reference"] is None and rec["id"] == "0"
    msgs = build_messages(rec)
    assert [m["role"] for m in msgs] == ["system", "user"] and "link 1: red scarf." in msgs[0]["content"]


def test_musique_format(tmp_path):
    p = write_lines(tmp_path / "m.jsonl", [json.dumps(MUSIQUE)])
    (rec,), _ = load_jsonl(p)
    assert rec["meta"]["kind"] == "musique"
    assert rec["meta"]["answers"] == ["Seine", "the Seine", "River Seine"]
    assert rec["documents"][0] == "Paris: Paris is the capital of France."
    assert "paragraphs:" in build_messages(rec)[0]["content"]


def test_history_becomes_turns():
    room = next(r for r in make_rooms(50, seed=0) if len(r["history"]) == 2)
    roles = [m["role"] for m in build_messages(room)]
    assert roles == ["system", "user", "assistant", "user", "assistant", "user"]


@pytest.mark.parametrize("line, why", [
    ('{"documents": [], "question": "x"', "malformed JSON"),
    ('{"question": "x"}', "missing required field(s) 'documents'"),
    ('{"documents": "abc", "question": "x"}', "'documents' must be a list"),
    ('{"documents": [], "question": ""}', "'question' must be a non-empty string"),
    ('{"documents": [], "question": "x", "history": [{"question": "y"}]}', "'history' must be a list"),
    ('{"paragraphs": [], "question": "x"}', "MuSiQue record is missing the string field 'answer'"),
    ('[1, 2]', "expected a JSON object"),
])
def test_bad_line_names_file_and_line(tmp_path, line, why):
    good = json.dumps({"documents": ["a"], "question": "q"})
    p = write_lines(tmp_path / "bad.jsonl", [good, "", line, good])
    with pytest.raises(DataError) as e:
        load_jsonl(p)
    assert f"{p}:3:" in str(e.value) and why in str(e.value)
    records, stats = load_jsonl(p, skip_bad_lines=True)
    assert len(records) == 2 and [s[0] for s in stats.skipped] == [3]


def test_missing_file():
    with pytest.raises(DataError, match="no such file"):
        load_jsonl("/nonexistent/x.jsonl")


def test_split_thought():
    assert split_thought("<think>a b</think> c.") == ("a b", "c.")
    assert split_thought("just text") == ("", "just text")
    assert split_thought("<think>unfinished") == ("", "<think>unfinished")


@pytest.mark.parametrize("doc, why", [
    ({"link": 1, "name": "scarf", "attributes": [1, 2]}, "document field 'attributes' must be an object of name: string or number, got [1, 2]"),
    ({"link": 1, "name": ["scarf"]}, "document field 'name' must be str, got [\"scarf\"]"),
    ({"link": {"x": 1}, "name": "scarf"}, "document field 'link' must be str or int"),
    ({"title": 3, "paragraph_text": "t"}, "document field 'title' must be a string, got 3"),
    (7, "each document must be a string or an object, got int"),
])
def test_fields_of_the_wrong_type_name_file_and_line(tmp_path, doc, why):
    good = json.dumps({"documents": ["a"], "question": "q"})
    p = write_lines(tmp_path / "bad.jsonl", [good, json.dumps({"documents": [doc], "question": "q"}), good])
    with pytest.raises(DataError) as e:
        load_jsonl(p)
    assert f"{p}:2: {why}" in str(e.value)
    records, stats = load_jsonl(p, skip_bad_lines=True)
    assert len(records) == 2 and [s[0] for s in stats.skipped] == [2]


@pytest.mark.parametrize("field, value, why", [
    ("reference", 5, "field 'reference' must be a string, got 5"),
    ("id", [1], "field 'id' must be a string or an integer"),
    ("meta", "x", "field 'meta' must be an object"),
])
def test_top_level_fields_of_the_wrong_type(tmp_path, field, value, why):
    p = write_lines(tmp_path / "bad.jsonl", [json.dumps({"documents": ["a"], "question": "q", field: value})])
    with pytest.raises(DataError, match=f"bad.jsonl:1: {why}".replace("(", r"\(").replace("[", r"\[")):
        load_jsonl(p)


def test_a_line_that_is_not_utf8_is_named_and_skippable(tmp_path):
    good = json.dumps({"documents": ["a"], "question": "q"}).encode()
    p = tmp_path / "latin1.jsonl"
    p.write_bytes(good + b"\n" + '{"documents": ["caf\u00e9"], "question": "q"}'.encode("latin-1") + b"\n" + good + b"\n")
    with pytest.raises(DataError, match=r"latin1\.jsonl:2: not UTF-8 \(byte 0xe9 at byte 20 of the line\)"):
        load_jsonl(str(p))
    records, stats = load_jsonl(str(p), skip_bad_lines=True)
    assert len(records) == 2 and [s[0] for s in stats.skipped] == [2]


def test_a_line_nested_too_deep_or_with_a_lone_surrogate_is_named(tmp_path):
    """Nesting past MAX_JSON_DEPTH and lone surrogates are refused per line (file and line named), not as a
    RecursionError traceback or a later tokenizer failure; with skip_bad_lines they are skipped."""
    from livemoe.train.live.data import load_sessions

    good = json.dumps({"documents": ["link 1: red scarf."], "question": "color?"})
    deep = '{"documents": ["d"], "question": "q", "meta": {"x": ' + "[" * 5000 + "]" * 5000 + "}}"
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join([good, deep, json.dumps({"documents": ["d"], "question": "q \ud800"})]) + "\n")
    with pytest.raises(DataError, match=r"d\.jsonl:2: JSON nested more than 128 levels"):
        load_jsonl(str(path))
    records, stats = load_jsonl(str(path), skip_bad_lines=True)
    assert len(records) == 1 and [n for n, _ in stats.skipped] == [2, 3]
    assert "lone surrogate" in stats.skipped[1][1]
    live = tmp_path / "s.jsonl"
    live.write_text('{"id": "a", "system": "s", "intervals": ' + "[" * 5000 + "]" * 5000 + "}\n")
    with pytest.raises(DataError, match=r"s\.jsonl:1: JSON nested more than 128 levels"):
        load_sessions(str(live))
    live.write_text(json.dumps({"id": "a", "system": "s \udfff", "intervals": []}) + "\n")
    with pytest.raises(DataError, match=r"s\.jsonl:1: text is not valid Unicode"):
        load_sessions(str(live))
