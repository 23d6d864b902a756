"""Routed experts: the top-k expert ids every MoE layer picked for each token a request ran through the model
(`SamplingParams(return_routed_experts=True)`), for routing replay in an RL trainer (R3).

The array is [tokens, MoE layers, k], uint8 when the model has at most 256 experts, else int16; row i is the
token at position i of prompt + output, for every token the model ran: all but the last sampled token (it is
never fed back). Over HTTP it is one JSON object {"data": base64 of the raw little-endian C-order bytes,
"shape": [tokens, layers, k], "dtype": "uint8" | "int16"}: a 30B-A3B rollout of 4k tokens is 1.5 MB raw where
nested lists would be ~4x that.
"""
import base64

import numpy as np
import torch

from livemoe.engine.errors import RequestError

_DTYPES = {"uint8": np.uint8, "int16": np.int16}


def routed_dtype(num_experts: int) -> torch.dtype:
    """The compact id type: uint8 up to 256 experts, int16 up to 32768."""
    if num_experts <= 256:
        return torch.uint8
    if num_experts <= 2**15:
        return torch.int16
    raise ValueError(f"routed experts: {num_experts} experts do not fit int16 ids")


def encode(ids: np.ndarray) -> dict:
    """[tokens, layers, k] -> the JSON object of the module doc."""
    name = ids.dtype.name
    if name not in _DTYPES or ids.ndim != 3:
        raise ValueError(f"routed experts must be a uint8 or int16 [tokens, layers, k] array, got {name} {ids.shape}")
    raw = np.ascontiguousarray(ids, dtype=np.dtype(_DTYPES[name]).newbyteorder("<")).tobytes()
    return {"data": base64.b64encode(raw).decode("ascii"), "shape": list(ids.shape), "dtype": name}


def decode(obj: dict) -> np.ndarray:
    """The JSON object of the module doc -> the [tokens, layers, k] array; RequestError naming what is wrong."""
    try:
        dtype = np.dtype(_DTYPES[obj["dtype"]]).newbyteorder("<")
        shape = tuple(int(x) for x in obj["shape"])
        raw = base64.b64decode(obj["data"], validate=True)
    except (KeyError, TypeError, ValueError) as e:
        raise RequestError(f"routed_experts: not a {{data, shape, dtype}} object ({e!r})") from None
    if len(shape) != 3 or len(raw) != int(np.prod(shape)) * dtype.itemsize:
        raise RequestError(f"routed_experts: {len(raw)} bytes do not hold a {obj['dtype']} array of shape {shape}")
    return np.frombuffer(raw, dtype=dtype).astype(dtype.newbyteorder("="), copy=True).reshape(shape)
