"""Weights from a trainer to running engine cores over a torch.distributed group, with no checkpoint on
disk (as OpenRLHF and verl push them to vLLM): the trainer is rank 0 and broadcasts each tensor; each
engine core (replica i) is rank rank_offset + i and receives into a fresh buffer, then copies it in
through the loader's name mapping (livemoe.engine.model.weights).

The group is standalone (a TCPStore and a ProcessGroupGloo / ProcessGroupNCCL of its own), not
torch.distributed's default group, so it lives beside a trainer's own FSDP group and several can exist
in one process. gloo on CPUs (the tests), NCCL between GPUs. Every operation has the group's timeout: a
peer that never comes ends the wait with an error, not a hang. Tensors travel in buckets (consecutive
tensors of one dtype, flattened into one buffer of up to BUCKET_BYTES): one broadcast per bucket, not
per tensor (measured on the CPU: a broadcast per tensor made a 1 MiB model's update 2.5x slower than
reading it from disk); both sides cut the same buckets from the same (names, dtypes, shapes) list.

    sender = WeightSender("127.0.0.1", port, world_size=1 + num_replicas)   # with the servers' join
    push_weights_to_servers(urls, sender, model.named_parameters())
"""
import math
import threading
from datetime import timedelta

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}
BUCKET_BYTES = 256 * 2**20


def buckets(dtypes: list, shapes: list) -> list[range]:
    """Index ranges of consecutive tensors of one dtype whose bytes stay within BUCKET_BYTES (a larger
    tensor is a bucket of its own)."""
    out, start, size = [], 0, 0
    for i, (dtype, shape) in enumerate(zip(dtypes, shapes)):
        nbytes = math.prod(shape) * DTYPES[dtype].itemsize
        if i > start and (dtype != dtypes[start] or size + nbytes > BUCKET_BYTES):
            out.append(range(start, i))
            start, size = i, 0
        size += nbytes
    if dtypes:
        out.append(range(start, len(dtypes)))
    return out


def open_group(master_address: str, master_port: int, rank: int, world_size: int, backend: str = "gloo",
               timeout_s: float = 300.0):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if not (isinstance(world_size, int) and world_size >= 2 and isinstance(rank, int) and 0 <= rank < world_size):
        raise ValueError(f"rank {rank!r} of world_size {world_size!r}: need world_size >= 2 and 0 <= rank < world_size")
    timeout = timedelta(seconds=timeout_s)
    store: dist.Store = dist.TCPStore(master_address, int(master_port), world_size, is_master=rank == 0,
                                      timeout=timeout)
    store = dist.PrefixStore("livemoe-weights", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, options)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class WeightReceiver:
    """An engine core's end of the group."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 300.0):
        if rank == 0:
            raise ValueError("rank 0 is the trainer's; engine cores take rank_offset >= 1")
        self.group = open_group(master_address, master_port, rank, world_size, backend, timeout_s)

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]], device):
        """The (name, tensor) pairs as they arrive (see receive_buckets)."""
        return receive_buckets(self.group, names, dtypes, shapes, device)


def check_metadata(names: list[str], dtypes: list[str], shapes: list[list[int]]) -> None:
    if not (len(names) == len(dtypes) == len(shapes)) or not names:
        raise ValueError(f"names, dtypes and shapes must have one equal, non-zero length; got {len(names)}, "
                         f"{len(dtypes)}, {len(shapes)}")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise ValueError(f"dtypes: {bad[:3]} not one of {sorted(DTYPES)}")


def receive_buckets(group, names: list[str], dtypes: list[str], shapes: list[list[int]], device):
    """The (name, tensor) pairs received over `group` from its rank 0, an iterator that receives bucket by
    bucket as it is consumed (a bucket's tensors are views of one buffer: a caller that keeps copies of slices
    of them lets the buffer go). The metadata is checked at once."""
    check_metadata(names, dtypes, shapes)
    return _received(group, names, dtypes, shapes, device)


def _received(group, names, dtypes, shapes, device):
    for b in buckets(dtypes, shapes):
        flat = torch.empty(sum(math.prod(shapes[i]) for i in b), dtype=DTYPES[dtypes[b.start]], device=device)
        group.broadcast(flat, 0).wait()
        offset = 0
        for i in b:
            n = math.prod(shapes[i])
            yield names[i], flat[offset:offset + n].view(tuple(shapes[i]))
            offset += n


@torch.no_grad()
def send_buckets(group, named_tensors, device=None, metadata: dict | None = None) -> None:
    """Rank 0 of `group`: broadcasts the tensors in the order weights_metadata(named_tensors) lists them (each
    bucket moved to `device` first if given: the receivers' device picks the backend). With `metadata` (the
    names, dtypes and shapes, known before the tensors), named_tensors may be an iterator consumed as the
    buckets fill: a whole model never needs to be held at once (a trainer gathering its shards tensor by
    tensor); each tensor is cast to its listed dtype."""
    if metadata is None:
        named_tensors = list(named_tensors)
        metadata = weights_metadata(named_tensors)
    names, dtypes, shapes = metadata["names"], metadata["dtypes"], metadata["shapes"]
    tensors = iter(named_tensors)
    for b in buckets(dtypes, shapes):
        parts = []
        for i in b:
            name, t = next(tensors)
            if name != names[i] or list(t.shape) != list(shapes[i]):
                raise ValueError(f"weights: tensor {i} is {name!r} {list(t.shape)}, but the metadata sent lists "
                                 f"{names[i]!r} {list(shapes[i])}")
            parts.append(t.detach().reshape(-1).to(DTYPES[dtypes[i]]))
        flat = torch.cat(parts) if len(parts) > 1 else parts[0]
        group.broadcast(flat.contiguous() if device is None else flat.to(device).contiguous(), 0).wait()


class WeightSender:
    """The trainer's end (rank 0). Construct it while the servers join (init_weights_update_group)."""

    def __init__(self, master_address: str, master_port: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 300.0):
        self.group = open_group(master_address, master_port, 0, world_size, backend, timeout_s)

    def broadcast(self, named_tensors, metadata: dict | None = None) -> None:
        """Sends the tensors in the order weights_metadata(named_tensors) (or `metadata`) lists them."""
        send_buckets(self.group, named_tensors, metadata=metadata)


def weights_metadata(named_tensors: list) -> dict:
    """The body of POST /update_weights_from_distributed for these tensors (sent in this order)."""
    return dict(names=[n for n, _ in named_tensors], dtypes=[dtype_name(t.dtype) for _, t in named_tensors],
                shapes=[list(t.shape) for _, t in named_tensors])


def join_servers(urls: list[str], master_address: str, master_port: int, backend: str = "gloo",
                 timeout_s: float = 300.0, replicas_per_url: list[int] | None = None, api_key: str | None = None):
    """The trainer side of POST /init_weights_update_group on every server: returns the WeightSender.
    replicas_per_url: the ranks each server takes (its weight_update_ranks: replicas x tensor-parallel ranks)."""
    replicas = replicas_per_url or [_replicas(u, api_key) for u in urls]
    world_size = 1 + sum(replicas)
    offsets = [1 + sum(replicas[:i]) for i in range(len(urls))]
    bodies = [dict(master_address=master_address, master_port=master_port, rank_offset=o, world_size=world_size,
                   backend=backend) for o in offsets]
    return _while_posting(urls, "/init_weights_update_group", bodies, api_key,
                          lambda: WeightSender(master_address, master_port, world_size, backend, timeout_s), timeout_s)


def push_weights_to_servers(urls: list[str], sender: WeightSender, named_tensors, in_flight: str = "finish",
                            api_key: str | None = None, timeout_s: float = 300.0, metadata: dict | None = None,
                            weight_version: int | None = None) -> None:
    """POST /update_weights_from_distributed on every server while broadcasting the tensors (an iterator, consumed
    as it is sent, when `metadata` lists them beforehand); weight_version: the new weights' label."""
    if metadata is None:
        named_tensors = list(named_tensors)
        metadata = weights_metadata(named_tensors)
    body = dict(metadata, in_flight=in_flight, weight_version=weight_version)
    _while_posting(urls, "/update_weights_from_distributed", [body] * len(urls), api_key,
                   lambda: sender.broadcast(named_tensors, metadata), timeout_s)


def _replicas(url: str, api_key: str | None) -> int:
    import json
    import urllib.request

    req = urllib.request.Request(url + "/get_server_info", headers=_auth(api_key))
    with urllib.request.urlopen(req, timeout=30) as r:
        info = json.load(r)
    return int(info.get("weight_update_ranks", info["data_parallel_size"]))


def _auth(api_key):
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _while_posting(urls, path, bodies, api_key, work, timeout_s: float):
    """Posts to every server (threads) while `work` runs here; raises the first failure."""
    import json
    import urllib.error
    import urllib.request

    errors: list[str] = []

    def post(url, body):
        req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json", **_auth(api_key)})
        try:
            urllib.request.urlopen(req, timeout=timeout_s).read()
        except urllib.error.HTTPError as e:
            errors.append(f"{url}{path}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}")
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(f"{url}{path}: {e!r}")

    threads = [threading.Thread(target=post, args=(u, b), daemon=True) for u, b in zip(urls, bodies)]
    for t in threads:
        t.start()
    try:
        result = work()
    finally:
        for t in threads:
            t.join(timeout_s)
    if errors:
        raise RuntimeError("; ".join(errors))
    return result
