"""An OpenAI-compatible chat endpoint, for remote teachers and LLM judges (urllib; no extra packages).

Concurrency cap, retries with exponential backoff on transient errors, a timeout per request. An
endpoint that cannot be reached at all fails fast with EndpointError naming the URL, before any work.
"""
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

TRANSIENT = {408, 409, 429, 500, 502, 503, 504}


class EndpointError(ValueError):
    """The endpoint is unreachable or keeps failing: the message names the URL."""


def _text(choice: dict) -> str:
    """The message content; reasoning returned apart (reasoning_content) goes back into <think>...</think>."""
    msg = choice["message"]
    content = msg.get("content") or ""
    reasoning = msg.get("reasoning_content")
    return f"<think>{reasoning}</think>{content}" if reasoning else content


class ChatEndpoint:
    def __init__(self, url: str, model: str = "default", api_key: str | None = None, concurrency: int = 8,
                 retries: int = 3, backoff_s: float = 1.0, timeout_s: float = 60.0, max_tokens: int = 1024):
        if not url.startswith(("http://", "https://")):
            raise EndpointError(f"endpoint URL {url!r} must start with http:// or https://")
        base = url.rstrip("/")
        self.url = base if base.endswith("/chat/completions") else base + (
            "/chat/completions" if base.endswith("/v1") else "/v1/chat/completions")
        self.model, self.api_key = model, api_key
        self.concurrency, self.retries, self.backoff_s = max(1, concurrency), retries, backoff_s
        self.timeout_s, self.max_tokens = timeout_s, max_tokens
        self.failures = 0  # transient failures retried, over all threads
        self._lock = threading.Lock()

    def _post(self, payload: dict) -> dict:
        req = urllib.request.Request(self.url, data=json.dumps(payload).encode(), method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {self.api_key}"} if self.api_key else {})})
        with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
            return json.loads(r.read().decode())

    def chat(self, messages: list, temperature: float = 0.0, n: int = 1) -> list:
        """n completions (strings) of one conversation, retried with backoff on transient failures."""
        payload = {"model": self.model, "messages": messages, "temperature": temperature, "n": n,
                   "max_tokens": self.max_tokens}
        for attempt in range(self.retries + 1):
            try:
                texts = [_text(c) for c in self._post(payload)["choices"]]
                while len(texts) < n:  # servers that ignore n: ask again for the rest
                    texts += [_text(c) for c in self._post({**payload, "n": 1})["choices"]]
                return texts[:n]
            except urllib.error.HTTPError as e:
                if e.code not in TRANSIENT or attempt == self.retries:
                    raise EndpointError(f"{self.url}: HTTP {e.code} {e.reason}") from None
            except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
                if attempt == self.retries:
                    raise EndpointError(f"{self.url}: unreachable after {attempt + 1} tries ({e})") from None
            except (KeyError, IndexError, TypeError, json.JSONDecodeError) as e:
                raise EndpointError(f"{self.url}: not an OpenAI-style chat completion ({e!r})") from None
            with self._lock:
                self.failures += 1
            time.sleep(self.backoff_s * 2 ** attempt)
        raise AssertionError("unreachable")

    def check(self) -> None:
        """Fail fast: one connection attempt, no retries, short timeout."""
        try:
            req = urllib.request.Request(self.url, data=b"{}", method="POST",
                                         headers={"Content-Type": "application/json"})
            urllib.request.urlopen(req, timeout=min(5.0, self.timeout_s)).close()
        except urllib.error.HTTPError:
            return  # it answered: reachable
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            raise EndpointError(f"{self.url}: unreachable ({getattr(e, 'reason', e)})") from None

    def chat_many(self, conversations: list, temperature: float = 0.0, n: int = 1) -> list:
        """chat() over many conversations, at most `concurrency` in flight; results in input order."""
        with ThreadPoolExecutor(self.concurrency) as pool:
            return list(pool.map(lambda m: self.chat(m, temperature, n), conversations))
