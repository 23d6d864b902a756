"""Structured output: grammar-constrained decoding with xgrammar.

    SamplingParams(structured=StructuredOutput(json={"type": "object", ...}))   # or json_object=True,
        regex="...", choice=["yes", "no"], grammar="root ::= ...", tool_call=[{"name", "parameters"}]

Why xgrammar (both measured on our sampler with the tiny byte-level BPE tokenizer of tests/, one CPU
thread, a decision-shaped schema, 70 tokens of output): xgrammar compiles it in 1.4 ms (6 ms the first
time in a process) and fills a row's token mask in ~1.1-1.6 us a token; llguidance makes its matcher in
~1 ms but builds its lexer lazily at the first mask (8-25 ms, which would land on the step loop), then
fills a mask in ~13 us a token, 8-10x xgrammar's per-step cost. xgrammar also has rollback (speculative
steps later), bitmask kernels for CPU and GPU, and is what vLLM and SGLang use by default. Its EBNF is
GBNF (llama.cpp's); Lark grammars are not accepted.

Compilation is cached by the spec per tokenizer (`GrammarCompiler`, one per engine) and happens when a
request is added: `AsyncLLM` runs it in a worker thread before the request reaches the engine loop, so
the loop only looks the compiled grammar up. A bad schema, regex or grammar fails there, as a
RequestError naming the field.

`GrammarState` is the one place a sequence's matcher moves: `advance` after a token is appended,
`rollback` to take tokens back (speculative or multi-token steps), `fill` to write its next-token mask.

Reasoning models: with `think_tokens` (the ids of `<think>` and `</think>`, each one token, as in Qwen3
and DeepSeek-R1) the grammar applies to the answer only: the output is free until `</think>`, unless the
prompt already closed the think block (a chat template with thinking turned off), as vLLM does.
"""
import json
import os
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from livemoe.engine.errors import RequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar", "tool_call")
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"  # Qwen3 / Hermes tool-call markup


@dataclass(frozen=True, kw_only=True)
class StructuredOutput:
    """Exactly one of: json (a JSON schema, dict or JSON text), json_object (any JSON object), regex,
    choice (one of these strings), grammar (EBNF, GBNF syntax), tool_call (a list of {"name",
    "parameters"}: the output is one `<tool_call>{"name": ..., "arguments": ...}</tool_call>` whose
    arguments match that function's parameter schema)."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None  # a list is accepted (and kept as a tuple)
    grammar: str | None = None
    tool_call: tuple[dict, ...] | None = None  # a list is accepted (and kept as a tuple)
    think_tokens: tuple[int, int] | None = None  # (<think>, </think>) ids: constrain only the answer

    def __post_init__(self):
        given = [k for k in KINDS if (getattr(self, k) is not None and getattr(self, k) is not False)]
        if len(given) != 1:
            raise RequestError(f"StructuredOutput: give exactly one of {KINDS}, got {given or 'none'}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as e:
                    raise RequestError(f"StructuredOutput: json schema is not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise RequestError(f"StructuredOutput: json schema must be an object, got {type(schema).__name__}")
        if self.json_object is not False and self.json_object is not True:
            raise RequestError(f"StructuredOutput: json_object must be a bool, got {self.json_object!r}")
        for name in ("regex", "grammar"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise RequestError(f"StructuredOutput: {name} must be a non-empty string, got {v!r}")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise RequestError(f"StructuredOutput: choice must be a non-empty list of non-empty strings, "
                                   f"got {self.choice!r}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.tool_call is not None:
            ok = (isinstance(self.tool_call, (list, tuple)) and self.tool_call
                  and all(isinstance(f, dict) and isinstance(f.get("name"), str) and f["name"] for f in self.tool_call))
            if not ok:
                raise RequestError("StructuredOutput: tool_call must be a non-empty list of {'name': str, "
                                   "'parameters': schema}")
            object.__setattr__(self, "tool_call", tuple(self.tool_call))
        if self.think_tokens is not None:
            if (not isinstance(self.think_tokens, (list, tuple)) or len(self.think_tokens) != 2
                    or not all(isinstance(t, int) and t >= 0 for t in self.think_tokens)):
                raise RequestError(f"StructuredOutput: think_tokens must be two token ids, got {self.think_tokens!r}")
            object.__setattr__(self, "think_tokens", tuple(self.think_tokens))

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) is not None and getattr(self, k) is not False)

    @property
    def key(self) -> str:
        """The cache key: the kind and its value as canonical JSON."""
        value = getattr(self, self.kind)
        if self.kind == "json" and isinstance(value, str):
            value = json.loads(value)
        return self.kind + ":" + json.dumps(value, sort_keys=True, ensure_ascii=False)


def _xgr():
    try:
        import xgrammar
    except ImportError as e:  # a runtime dependency; an image built without it gets told, not a 500
        raise RequestError(f"structured output needs xgrammar, which is not installed ({e}); "
                           f"pip install xgrammar") from None
    return xgrammar


def _message(e: Exception) -> str:
    """xgrammar's C++ errors start with '[time] /path/file.cc:line: '; keep what follows."""
    text = str(e).strip()
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text).splitlines()[0] if text else type(e).__name__


def _literal(text: str) -> str:
    """An EBNF string literal (JSON escapes are GBNF's)."""
    return json.dumps(text, ensure_ascii=False)


# xgrammar (0.2.9) spells a JSON string's characters as [^"\\\r\n] when its length is bounded (raw control
# characters get through: invalid JSON, and a byte-level vocabulary has a token for each) and as
# [^\0-\x1f"\\\r\n] otherwise; both let UTF-16 surrogates through, whose UTF-8 bytes are no valid text.
_STRING_CHARS = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]')
_VALID_STRING_CHAR = r'[^\0-\x1f\"\\\uD800-\uDFFF]'


def _json_grammar(schema: str, strict: bool = True):
    """The xgrammar Grammar of a JSON schema: compact separators, no free whitespace (a sampled model would
    otherwise fill it with spaces), and only valid characters inside strings."""
    xgr = _xgr()
    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=strict))
    for chars in _STRING_CHARS:
        text = text.replace(chars, _VALID_STRING_CHAR)
    return xgr.Grammar.from_ebnf(text)


def tool_call_schema(functions) -> dict:
    """The JSON of one Hermes-style call to any of `functions`: {"name": <const>, "arguments": <params>}.
    Each function's parameters are a schema of their own: their `$defs` (and `definitions`) and the refs to them
    (recursive ones included, and `#` for the parameters themselves) are moved to the root under names of that
    function, so a schema valid as response_format is valid as a tool's parameters too."""
    defs: dict = {}
    options = []
    for i, f in enumerate(functions):
        params = f.get("parameters") or {"type": "object"}
        if isinstance(params, dict) and _has_refs(params):
            params = _hoisted(params, f"f{i}_", defs)
        options.append({"type": "object", "properties": {"name": {"const": f["name"]}, "arguments": params},
                        "required": ["name", "arguments"], "additionalProperties": False})
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "$defs": defs} if defs else schema


def _has_refs(node) -> bool:
    if isinstance(node, dict):
        return "$ref" in node or "$defs" in node or "definitions" in node or any(map(_has_refs, node.values()))
    return isinstance(node, list) and any(map(_has_refs, node))


def _hoisted(params: dict, prefix: str, defs: dict) -> dict:
    """params with its definitions moved into defs (names prefixed) and its local refs rewritten to match."""
    def rewrite(node):
        if isinstance(node, list):
            return [rewrite(x) for x in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                out[key] = _moved_ref(value, prefix)
            elif key in ("$defs", "definitions") and node is params and isinstance(value, dict):
                continue
            else:
                out[key] = rewrite(value)
        return out

    for key in ("$defs", "definitions"):
        for name, sub in (params.get(key) or {}).items():
            defs[f"{prefix}{key.strip('$')}_{name}"] = rewrite(sub)
    body = rewrite(params)
    defs[f"{prefix}root"] = body  # the target of `#` inside the parameters
    return body


def _moved_ref(ref: str, prefix: str) -> str:
    if ref == "#":
        return f"#/$defs/{prefix}root"
    for key in ("$defs", "definitions"):
        head = f"#/{key}/"
        if ref.startswith(head):
            name, _, rest = ref[len(head):].partition("/")
            return f"#/$defs/{prefix}{key.strip('$')}_{name}" + (f"/{rest}" if rest else "")
    return ref  # another ref (a URL, a JSON pointer into the parameters): as it was


class GrammarCompiler:
    """Compiles StructuredOutput specs for one tokenizer, caching the results (LRU, `cache_size` specs).
    Thread-safe: the server compiles in worker threads while the engine thread looks results up."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids, cache_size: int = 256,
                 max_threads: int = min(8, os.cpu_count() or 1)):  # xgrammar's own pool for one compile (vLLM: 8)
        if tokenizer is None:
            raise RequestError("structured output needs a tokenizer, and this checkpoint has none")
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=max_threads, cache_enabled=False)
        self.cache: OrderedDict[str, object] = OrderedDict()
        self.cache_size = cache_size
        self.lock = threading.Lock()
        self.num_compiled = 0

    def compile(self, spec: StructuredOutput, field: str = "structured"):
        """The compiled grammar of spec (cached). field: what to name in the error of a bad spec."""
        key = spec.key
        with self.lock:
            hit = self.cache.get(key)
            if hit is not None:
                self.cache.move_to_end(key)
                return hit
        try:
            compiled = self._compile(spec)
        except RequestError:
            raise
        except Exception as e:  # xgrammar's RuntimeError for a bad schema, regex or grammar
            raise RequestError(f"{field}: invalid {spec.kind.replace('_', ' ')}: {_message(e)}") from None
        with self.lock:
            self.num_compiled += 1
            self.cache[key] = compiled
            if len(self.cache) > self.cache_size:
                self.cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutput):
        xgr, c = _xgr(), self.compiler
        kind = spec.kind
        if kind == "json":
            return c.compile_grammar(_json_grammar(spec.json if isinstance(spec.json, str) else json.dumps(spec.json)))
        if kind == "json_object":
            return c.compile_grammar(_json_grammar('{"type": "object"}', strict=False))
        if kind == "regex":
            return c.compile_regex(spec.regex)
        if kind == "choice":
            assert spec.choice is not None  # its kind
            return c.compile_grammar("root ::= " + " | ".join(_literal(s) for s in spec.choice))
        if kind == "grammar":
            return c.compile_grammar(spec.grammar)
        call = _json_grammar(json.dumps(tool_call_schema(spec.tool_call)))
        return c.compile_grammar(xgr.Grammar.concat(
            xgr.Grammar.from_ebnf(f"root ::= {_literal(TOOL_CALL_OPEN + chr(10))}"), call,
            xgr.Grammar.from_ebnf(f"root ::= {_literal(chr(10) + TOOL_CALL_CLOSE)}")))

    def state(self, spec: StructuredOutput, prompt_ids: Sequence[int] = ()) -> "GrammarState":
        wait_for = None
        if spec.think_tokens is not None:
            start, end = spec.think_tokens
            last = {t: i for i, t in enumerate(prompt_ids) if t in spec.think_tokens}
            closed = last.get(end, -1) > last.get(start, -1)  # the prompt's think block is already over
            wait_for = None if closed else end
        return GrammarState(self.compile(spec), wait_for)


class GrammarState:
    """One sequence's matcher over its output tokens (those after `wait_for`, when given)."""

    def __init__(self, compiled, wait_for: int | None = None):
        self.wait_for = wait_for  # the output is free until this token (a reasoning model's </think>)
        self.matcher = _xgr().GrammarMatcher(compiled)  # rollback is unbounded in xgrammar >= 0.2
        self.num_tokens = 0  # output tokens the matcher has consumed

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    @property
    def active(self) -> bool:
        return self.wait_for is None

    def advance(self, token_ids: list[int]) -> None:
        """Consumes the tokens the sampler chose (the mask allowed them, so the matcher accepts them)."""
        for t in token_ids:
            if self.wait_for is not None:
                if t == self.wait_for:
                    self.wait_for = None
                continue
            ok = self.matcher.accept_token(t)
            assert ok, f"the grammar rejected token {t}, which its own mask allowed"
            self.num_tokens += 1

    def rollback(self, num_tokens: int) -> None:
        """Takes back the last num_tokens the matcher consumed (not those before </think>)."""
        assert 0 <= num_tokens <= self.num_tokens, (num_tokens, self.num_tokens)
        self.matcher.rollback(num_tokens)
        self.num_tokens -= num_tokens

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Sets the tokens each constrained row's grammar forbids to -inf, in place (rows index logits)."""
    xgr = _xgr()
    bitmask = xgr.allocate_token_bitmask(len(rows), logits.shape[-1])
    for j, state in enumerate(states):
        state.fill(bitmask, j)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if len(rows) == logits.shape[0]:
        xgr.apply_token_bitmask_inplace(logits, bitmask)
    else:
        sub = logits[rows]
        xgr.apply_token_bitmask_inplace(sub, bitmask)
        logits[rows] = sub
