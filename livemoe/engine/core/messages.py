"""The messages between an engine-core client and its core: typed msgspec structs (array-like, defaults left
out, as vLLM v1's EngineCoreRequest), sent as msgpack frames. The in-thread core takes the same structs unencoded.

SamplingParams and the output metrics are dataclasses msgspec encodes field by field. Objects msgpack has no type
for (the tensors of a weight update, an exception the client re-raises) travel as a pickle inside a msgpack
extension, as vLLM's encoder does; the sockets are ipc:// files in a directory only this user can open, between
processes of one program.
"""
import pickle
from typing import Any

import msgspec

from livemoe.engine.outputs import RequestMetrics
from livemoe.engine.sampling.params import SamplingParams

PICKLE_EXT = 1


class Message(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


# -- client -> core ------------------------------------------------------------------------------------


class AddRequest(Message):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None  # the text it was tokenized from (the in-thread core's outputs carry it)
    # a live session's key: when the request finishes, its KV blocks stay pinned for the session's next step
    # (CoreService keeps one pin per key, released by the call `unpin`)
    pin_key: str | None = None
    # the prompt's media (livemoe.engine.multimodal.media.PlacedMedia, with their tensors; a pickle on the wire)
    media: Any = None


class Abort(Message):
    request_ids: list[str]


class Call(Message):
    """A method of the core's (CoreService.call_<method>) with its arguments; answered by a Return. Over a socket
    the arguments go as `pickled(...)`: they are any objects (tensors, StructuredOutput specs)."""
    call_id: int
    method: str
    args: Any = ()
    kwargs: Any = {}


class Stop(Message):
    pass


Command = AddRequest | Abort | Call | Stop

# -- core -> client ------------------------------------------------------------------------------------


class Ready(Message):
    max_model_len: int
    block_size: int
    pid: int
    stats: dict[str, Any]
    eos_token_ids: list[int] = []


class FailedToStart(Message):
    error: Any  # the exception, which the client raises


class CompletionDelta(Message):
    """One completion's tokens since the last delta; its finish, and the text a stop string cut (the core detects
    stop strings, so it has it; other texts the client detokenizes)."""
    index: int
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str | None = None
    routed_experts: Any = None  # on the last delta, with return_routed_experts: the numpy array (pickled)
    weight_versions: list | None = None  # with return_weight_versions: those of this delta's tokens


class RequestDelta(Message):
    request_id: str
    completions: list[CompletionDelta]
    metrics: RequestMetrics | None = None  # set on the last delta: the request finished
    prompt_logprobs: list[dict[int, float] | None] | None = None  # on the first delta, when the request asked


class Rejected(Message):
    request_id: str
    error: Any  # RequestError (a bad request) or EngineSleepingError: the client raises it


class Outputs(Message):
    """What happened in the core since its last message."""
    deltas: list[RequestDelta]
    accepted: list[str]
    rejected: list[Rejected]
    failed: dict[str, str]  # request id -> why the core ended it
    stats: dict[str, Any]


class Return(Message):
    call_id: int
    ok: bool
    result: Any  # the method's result, or the exception it raised
    stats: dict[str, Any]


Reply = Ready | FailedToStart | Outputs | Return


def pickled(obj) -> msgspec.msgpack.Ext:
    """obj as a pickle even where msgpack could encode it (a dataclass would arrive as a dict); decoded back
    into obj where the field is typed Any."""
    return msgspec.msgpack.Ext(PICKLE_EXT, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _enc_hook(obj):
    return pickled(obj)


def _ext_hook(code: int, data: memoryview):
    if code == PICKLE_EXT:
        return pickle.loads(data)
    raise ValueError(f"unknown msgpack extension type {code}")


class Codec:
    """Encodes either direction; decodes the messages of one (`Command` on the core, `Reply` on the client)."""

    def __init__(self, receives=Command):
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(receives, ext_hook=_ext_hook)

    def encode(self, message: Message) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data):
        return self._decoder.decode(data)
