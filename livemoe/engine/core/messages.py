"""The wire format between a client and an engine core: msgpack (msgspec) frames, as vLLM v1 sends.

The hot path (requests in, token deltas out) is plain msgpack of lists, strings and numbers. Objects
msgpack has no type for (SamplingParams with its structured-output spec, tensors in a weight update,
exceptions) travel as a pickle inside a msgpack extension, as vLLM's encoder does; the sockets are
ipc:// files in a directory only this user can open, between processes of one program.
"""
import pickle

import msgspec

PICKLE_EXT = 1

# client -> core
ADD, ABORT, CALL, STOP = "add", "abort", "call", "stop"
# core -> client
READY, FAILED_TO_START, OUTPUTS, RETURN = "ready", "failed_to_start", "outputs", "return"


def _enc_hook(obj):
    return msgspec.msgpack.Ext(PICKLE_EXT, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _ext_hook(code: int, data: memoryview):
    if code == PICKLE_EXT:
        return pickle.loads(data)
    raise ValueError(f"unknown msgpack extension type {code}")


class Codec:
    def __init__(self):
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)
        self._decoder = msgspec.msgpack.Decoder(ext_hook=_ext_hook)

    def encode(self, message) -> bytes:
        return self._encoder.encode(message)

    def decode(self, data):
        return self._decoder.decode(data)


def as_object(obj):
    """Sends obj as a pickle even where msgpack could encode it (a dataclass would arrive as a dict)."""
    return _enc_hook(obj)
