"""livemoe.engine.core.weight_sync's buckets from an iterator (a trainer gathering its shards tensor by tensor):
the same broadcasts as from a list, each tensor cast to the dtype the metadata lists, received back whole; a
tensor out of the metadata's order is refused by name. A recording group stands in for torch.distributed."""
import types

import pytest
import torch

from livemoe.engine.core import weight_sync
from livemoe.engine.core.weight_sync import receive_buckets, send_buckets, weights_metadata


class Recording:
    """Records what rank 0 broadcasts, and replays it to a receiver."""

    def __init__(self, sent=None):
        self.sent = [] if sent is None else list(sent)
        self.replaying = sent is not None

    def broadcast(self, t, root):
        assert root == 0
        if self.replaying:
            t.copy_(self.sent.pop(0))
        else:
            self.sent.append(t.clone())
        return types.SimpleNamespace(wait=lambda: None)


def named(dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 5), (7,), (2, 2, 3), (64, 8), (1,)]
    return [(f"t{i}", torch.randn(s, generator=g).to(dtype)) for i, s in enumerate(shapes)]


def test_streamed_equals_listed_and_round_trips(monkeypatch):
    monkeypatch.setattr(weight_sync, "BUCKET_BYTES", 300)  # several buckets, one tensor larger than a bucket
    tensors = named()
    listed, streamed = Recording(), Recording()
    send_buckets(listed, tensors)
    send_buckets(streamed, (pair for pair in tensors), metadata=weights_metadata(tensors))
    assert len(listed.sent) == len(streamed.sent) > 2
    assert all(torch.equal(a, b) for a, b in zip(listed.sent, streamed.sent))
    meta = weights_metadata(tensors)
    got = list(receive_buckets(Recording(streamed.sent), meta["names"], meta["dtypes"], meta["shapes"], "cpu"))
    assert [n for n, _ in got] == [n for n, _ in tensors]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got, tensors))


def test_streamed_tensors_take_the_listed_dtype_and_order():
    tensors = named(torch.float32)
    meta = dict(weights_metadata(tensors), dtypes=["bfloat16"] * len(tensors))
    rec = Recording()
    send_buckets(rec, iter(tensors), metadata=meta)
    assert all(t.dtype == torch.bfloat16 for t in rec.sent)
    with pytest.raises(ValueError, match="tensor 0 is 't1' \\[7\\], but the metadata sent lists 't0' \\[3, 5\\]"):
        send_buckets(Recording(), iter(tensors[1:]), metadata=weights_metadata(tensors))
