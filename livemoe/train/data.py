"""Examples for RFT and GRPO: JSONL in the seed's shape or MuSiQue's public format, and their prompts.

Seed shape (its section 3.1), one JSON object per line:
  {"id": str?, "documents": [str | {"link", "name", "attributes"} | {"title", "paragraph_text"}],
   "question": str, "history": [{"question": str, "response": str}]?, "reference": str?}
MuSiQue: {"id", "paragraphs": [{"title", "paragraph_text", ...}], "question", "answer", "answer_aliases"?}
Both load into the seed shape; MuSiQue's answers go to meta["answers"] for the EM/F1 judge.
A malformed line (not UTF-8, not JSON, a missing field or a field of the wrong type) raises DataError
naming the file and line (or, with --skip_bad_lines, is skipped and counted).
"""
import json
import os
from dataclasses import dataclass, field

from livemoe.engine.text.json_limits import depth_message, lone_surrogate, too_deep
from livemoe.train.synthetic import make_rooms

SYSTEM_PROMPT = "you are a live stream host. answer the viewer from the product list."
MUSIQUE_SYSTEM_PROMPT = "answer the question from the paragraphs."


class DataError(ValueError):
    """Bad input data: the message names the file and line."""


@dataclass
class LoadStats:
    path: str
    lines: int = 0
    loaded: int = 0
    skipped: list = field(default_factory=list)  # (line number, reason)


_SCALAR = (str, int, float)


def check_document(doc) -> None:
    """ValueError naming the field of a document whose value has the wrong type."""
    if isinstance(doc, str):
        return
    if not isinstance(doc, dict):
        raise ValueError(f"each document must be a string or an object, got {type(doc).__name__}")
    if "link" in doc and "name" in doc:
        for key, types in (("link", (str, int)), ("name", (str,))):
            if not isinstance(doc[key], types) or isinstance(doc[key], bool):
                raise ValueError(f"document field {key!r} must be {' or '.join(t.__name__ for t in types)}, "
                                 f"got {json.dumps(doc[key])}")
        attrs = doc.get("attributes", {})
        if not isinstance(attrs, dict) or not all(isinstance(v, _SCALAR) and not isinstance(v, bool)
                                                  for v in attrs.values()):
            raise ValueError(f"document field 'attributes' must be an object of name: string or number, "
                             f"got {json.dumps(attrs)[:80]}")
    elif "paragraph_text" in doc:
        for key in ("paragraph_text", "title"):
            if key in doc and not isinstance(doc[key], str):
                raise ValueError(f"document field {key!r} must be a string, got {json.dumps(doc[key])[:80]}")
    else:
        raise ValueError(f"unknown document shape with keys {sorted(doc)}")


def render_document(doc) -> str:
    if isinstance(doc, str):
        return doc
    if "link" in doc and "name" in doc:
        attrs = " ".join(f"{a}: {v}." for a, v in doc.get("attributes", {}).items())
        return f"link {doc['link']}: {doc['name']}. {attrs}".rstrip()
    if "paragraph_text" in doc:
        return f"{doc.get('title', '')}: {doc['paragraph_text']}".lstrip(": ")
    raise ValueError(f"unknown document shape with keys {sorted(doc)}")


def normalize_record(rec, index: int = 0) -> dict:
    """Validates one record and returns it in the seed shape. ValueError names the missing field."""
    if not isinstance(rec, dict):
        raise ValueError(f"expected a JSON object, got {type(rec).__name__}")
    if "paragraphs" in rec:  # MuSiQue
        for key in ("question", "answer"):
            if not isinstance(rec.get(key), str):
                raise ValueError(f"MuSiQue record is missing the string field {key!r}")
        if not isinstance(rec["paragraphs"], list) or not all(
                isinstance(p, dict) and "paragraph_text" in p for p in rec["paragraphs"]):
            raise ValueError("MuSiQue field 'paragraphs' must be a list of objects with 'paragraph_text'")
        for p in rec["paragraphs"]:
            check_document(p)
        aliases = rec.get("answer_aliases", [])
        if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
            raise ValueError("MuSiQue field 'answer_aliases' must be a list of strings")
        answers = [rec["answer"], *aliases]
        return {"id": str(rec.get("id", index)), "documents": [render_document(p) for p in rec["paragraphs"]],
                "question": rec["question"], "history": [], "reference": rec["answer"],
                "meta": {"kind": "musique", "answers": answers, "answerable": rec.get("answerable", True)}}
    missing = [k for k in ("documents", "question") if k not in rec]
    if missing:
        raise ValueError(f"record is missing required field(s) {', '.join(map(repr, missing))}")
    if not isinstance(rec["question"], str) or not rec["question"].strip():
        raise ValueError("field 'question' must be a non-empty string")
    if not isinstance(rec["documents"], list):
        raise ValueError("field 'documents' must be a list")
    for d in rec["documents"]:
        check_document(d)
    history = rec.get("history", [])
    if not isinstance(history, list) or not all(
            isinstance(h, dict) and isinstance(h.get("question"), str) and isinstance(h.get("response"), str)
            for h in history):
        raise ValueError("field 'history' must be a list of {'question': str, 'response': str}")
    if not isinstance(rec.get("id", ""), (str, int)) or isinstance(rec.get("id"), bool):
        raise ValueError(f"field 'id' must be a string or an integer, got {json.dumps(rec['id'])[:80]}")
    if not isinstance(rec.get("reference"), (str, type(None))):
        raise ValueError(f"field 'reference' must be a string, got {json.dumps(rec['reference'])[:80]}")
    if not isinstance(rec.get("meta", {}), dict):
        raise ValueError(f"field 'meta' must be an object, got {json.dumps(rec['meta'])[:80]}")
    out = dict(rec)
    out.setdefault("id", str(index))
    out["id"] = str(out["id"])
    out["history"] = history
    out.setdefault("reference", None)
    out.setdefault("meta", {})
    return out


def load_jsonl(path: str, skip_bad_lines: bool = False) -> tuple:
    """Returns (records in the seed shape, LoadStats). Raises DataError("path:line: why")."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    stats, records = LoadStats(path), []
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 is one bad line, not a failed file
        for lineno, raw in enumerate(f, 1):
            stats.lines = lineno
            try:
                line = raw.decode("utf-8")
                if not line.strip():
                    continue
                if too_deep(line) is not None:
                    raise ValueError(depth_message())
                obj = json.loads(line)
                if (why := lone_surrogate(obj)) is not None:
                    raise ValueError(why)
                rec = normalize_record(obj, index=len(records))
            except UnicodeDecodeError as e:
                reason = f"not UTF-8 (byte 0x{raw[e.start]:02x} at byte {e.start + 1} of the line)"
            except json.JSONDecodeError as e:
                reason = f"malformed JSON ({e.msg} at column {e.colno})"
            except ValueError as e:
                reason = str(e)
            else:
                records.append(rec)
                continue
            if not skip_bad_lines:
                raise DataError(f"{path}:{lineno}: {reason} (use --skip_bad_lines to skip such lines)")
            stats.skipped.append((lineno, reason))
    stats.loaded = len(records)
    return records, stats


def write_jsonl(path: str, records) -> None:
    """Writes to a temp file then renames, so a reader never sees half a file."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def build_messages(record: dict) -> list:
    """The chat the model sees: documents in the system turn, then the history, then the question."""
    musique = record.get("meta", {}).get("kind") == "musique"
    head = MUSIQUE_SYSTEM_PROMPT + "\nparagraphs:\n" if musique else SYSTEM_PROMPT + "\nproducts:\n"
    msgs = [{"role": "system", "content": head + "\n".join(render_document(d) for d in record["documents"])}]
    for h in record.get("history", []):
        msgs += [{"role": "user", "content": h["question"]}, {"role": "assistant", "content": h["response"]}]
    msgs.append({"role": "user", "content": record["question"]})
    return msgs


def build_prompt(record: dict, tokenizer) -> str:
    """The prompt text through the checkpoint's chat template, ending where the assistant starts."""
    return tokenizer.apply_chat_template(build_messages(record), tokenize=False, add_generation_prompt=True)


def split_thought(completion: str) -> tuple:
    """(thought, response) of `<think>T</think>R`; no closing tag means no thought."""
    if "</think>" not in completion:
        return "", completion.strip()
    thought, response = completion.split("</think>", 1)
    return thought.replace("<think>", "").strip(), response.strip()


def load_inputs(cfg) -> tuple:
    """(training inputs, held-out inputs) of a run config (livemoe.train.config.RunConfig): from --data /
    --eval_data, else synthetic rooms (RFT and GRPO train on the same ones)."""
    if cfg.data:
        train, stats = load_jsonl(cfg.data, cfg.skip_bad_lines)
        _report_skipped(stats)
    else:
        train = make_rooms(cfg.train_rooms, seed=cfg.seed, prefix="train")
    if cfg.eval_data:
        held_out, stats = load_jsonl(cfg.eval_data, cfg.skip_bad_lines)
        _report_skipped(stats)
    elif cfg.data:
        held_out = []  # nothing held out was given: no before/after table
    else:
        held_out = make_rooms(cfg.eval_rooms, seed=cfg.seed + 1_000_003, prefix="eval")
    if not train:
        raise ValueError(f"{cfg.data or 'synthetic data'}: no training inputs")
    return train, held_out


def _report_skipped(stats: LoadStats) -> None:
    if stats.skipped:
        print(f"[data] {stats.path}: skipped {len(stats.skipped)} bad line(s): " +
              "; ".join(f"line {n}: {why}" for n, why in stats.skipped[:5]), flush=True)
