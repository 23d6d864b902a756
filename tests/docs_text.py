"""The documentation as the tests read it: README.md and docs/*.md, their fenced blocks, and a section found by
its heading in whichever file it lives (sections move between files; the tests that quote them should not care)."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def doc_files() -> list[str]:
    """README.md, then docs/*.md, as paths relative to the repository root."""
    docs = sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))
    return ["README.md", *docs]


def read(path: str) -> str:
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def blocks(text: str, lang: str) -> list[str]:
    """The bodies of text's ```lang blocks, in order."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, flags=re.S | re.M)


def outside_code(text: str) -> str:
    """text with every fenced block's lines blanked (a bash comment is not a heading, a link in code no link)."""
    out, fence = [], False
    for line in text.split("\n"):
        if line.startswith("```"):
            fence = not fence
            out.append("")
        else:
            out.append("" if fence else line)
    return "\n".join(out)


def headings(text: str) -> list[tuple[int, str, int]]:
    """(level, title, line index) of each Markdown heading outside fenced blocks."""
    found = []
    for i, line in enumerate(outside_code(text).split("\n")):
        m = re.match(r"(#{1,6}) (.+?)\s*$", line)
        if m:
            found.append((len(m.group(1)), m.group(2), i))
    return found


def section(title: str) -> tuple[str, str]:
    """(file, text) of the section headed `title` (any level): from its heading to the next heading of the same or
    a higher level, subsections included. Exactly one of doc_files() must have it."""
    hits = []
    for path in doc_files():
        text = read(path)
        lines = text.split("\n")
        heads = headings(text)
        for n, (level, name, start) in enumerate(heads):
            if name == title:
                end = next((i for lv, _, i in heads[n + 1:] if lv <= level), len(lines))
                hits.append((path, "\n".join(lines[start:end])))
    assert len(hits) == 1, f"section {title!r} found {len(hits)} times in {doc_files()}: {[p for p, _ in hits]}"
    return hits[0]


def anchor(title: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but '-' and '_' dropped, spaces as '-'."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
