"""Examples for RFT and GRPO: JSONL in the seed's shape or MuSiQue's public format, and their prompts.

Seed shape (its section 3.1), one JSON object per line:
  {"id": str?, "documents": [str | {"link", "name", "attributes"} | {"title", "paragraph_text"}],
   "question": str, "history": [{"question": str, "response": str}]?, "reference": str?}
MuSiQue: {"id", "paragraphs": [{"title", "paragraph_text", ...}], "question", "answer", "answer_aliases"?}
Both load into the seed shape; MuSiQue's answers go to meta["answers"] for the EM/F1 judge.
A malformed line raises DataError naming the file and line (or is skipped and counted).
"""
import json
import os
from dataclasses import dataclass, field

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
        answers = [rec["answer"], *rec.get("answer_aliases", [])]
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
        if not isinstance(d, (str, dict)):
            raise ValueError("each document must be a string or an object")
        render_document(d)
    history = rec.get("history", [])
    if not isinstance(history, list) or not all(
            isinstance(h, dict) and isinstance(h.get("question"), str) and isinstance(h.get("response"), str)
            for h in history):
        raise ValueError("field 'history' must be a list of {'question': str, 'response': str}")
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
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            stats.lines = lineno
            if not line.strip():
                continue
            try:
                rec = normalize_record(json.loads(line), index=len(records))
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
