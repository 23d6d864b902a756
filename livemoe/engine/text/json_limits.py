"""Bounds on JSON read from outside (HTTP bodies, data files): nesting depth, checked before the parser recurses
(json.loads of ~1,000 nested arrays raises RecursionError, and everything that walks the result recurses too),
and text that is not valid Unicode (a lone surrogate, which JSON's \\ud800 escapes can carry, fails at the first
encode: a tokenizer, a log line, a response).

    too_deep(data) -> the depth past MAX_JSON_DEPTH, or None          (bytes or str; one regex pass, no parse)
    lone_surrogate(obj) -> a short description of the first bad text, or None
"""
import json
import re

MAX_JSON_DEPTH = 128  # deeper than any schema or message list a client sends; far from the recursion limit

# a string (skipped: brackets inside it are text) or a bracket
_TOKENS = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]', re.S)


def too_deep(data, limit: int = MAX_JSON_DEPTH) -> int | None:
    """The nesting depth of a JSON text once it passes `limit` (the text is not parsed: a malformed one may be
    counted deeper than a parser would get), or None when it stays within."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    if data.count(b"[") + data.count(b"{") <= limit:  # cannot be deeper than its brackets: no scan
        return None
    depth = 0
    for m in _TOKENS.finditer(data):
        c = m.group()
        if c in (b"[", b"{"):
            depth += 1
            if depth > limit:
                return depth
        elif c in (b"]", b"}"):
            depth -= 1
    return None


def depth_message(limit: int = MAX_JSON_DEPTH) -> str:
    return f"JSON nested more than {limit} levels deep (this server's and reader's limit)"


def lone_surrogate(obj) -> str | None:
    """None if every string (and key) in a parsed JSON value is valid Unicode, else what the first bad one is."""
    try:
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as e:
        return (f"text is not valid Unicode: a lone surrogate {e.object[e.start:e.end]!r} near "
                f"{e.object[max(0, e.start - 40):e.end + 10]!r}")
    return None
