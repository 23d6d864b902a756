"""ServerConfig: the HTTP server's limits and access options, typed and validated in one place (a
ValueError naming the option). `livemoe serve` has a flag for each field.

Limits bound every request dimension that multiplies work or memory; a request over one gets a 400
(413 for the body), so no request can take the server down or starve others. The defaults are sized for
a 2-core, 24 GB machine: at most 128 x 128 = 1024 sequences (`max_sequences`) per request.
"""
import ipaddress
from dataclasses import dataclass, fields

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")


@dataclass(kw_only=True)
class ServerConfig:
    max_n: int = 128  # completions per prompt (`n`); OpenAI's own bound
    max_prompts: int = 128  # prompts in one completions request
    max_sequences: int = 1024  # prompts x n in one request
    max_logprobs: int = 20  # `logprobs` / `top_logprobs`; OpenAI's own bound
    max_stop: int = 16  # stop strings in one request (each is searched at every step)
    max_body_bytes: int = 4 * 2**20  # a larger body gets a 413 before it is read
    body_timeout_s: float = 30.0  # a body not received in full by then gets a 408
    header_timeout_s: float = 10.0  # a connection without a request's headers by then is closed (sockets.py)
    api_key: str | None = None  # when set, every /v1 route needs `Authorization: Bearer KEY` (else 401)
    # Host header names accepted (comma-separated); None: loopback names when bound to loopback (so a web
    # page cannot reach the server through DNS rebinding), any name otherwise
    allowed_hosts: str | None = None
    enable_docs: bool = False  # serve /openapi.json and /docs
    max_grammar_compile_s: float = 10.0  # a response_format / guided_* / tool grammar compiling longer: a 400
    # the routes that change the server (weight updates, sleep / wake_up, the weight-update group: admin.py):
    # off unless enabled here or an api_key is set (they then need the key)
    enable_admin_routes: bool = False
    max_live_sessions: int = 256  # live sessions open at once (each pins KV blocks); a 429 past it
    # media content parts may name local files under this directory (None: data URLs only)
    allowed_local_media_path: str | None = None

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if f.type in (int, float) and not (number and value > 0 and (f.type is float or isinstance(value, int))):
                raise ValueError(f"ServerConfig: {f.name} must be a positive {f.type.__name__}, got {value!r}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("ServerConfig: api_key must not be empty")

    @property
    def admin_routes(self) -> bool:
        return self.enable_admin_routes or self.api_key is not None

    def host_names(self, bind_host: str) -> set[str] | None:
        """The Host header names accepted by a server bound to `bind_host` (None: any)."""
        if self.allowed_hosts is not None:
            return {h.strip().lower().strip("[]") for h in self.allowed_hosts.split(",") if h.strip()}
        return set(LOOPBACK_NAMES) if is_loopback(bind_host) else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
