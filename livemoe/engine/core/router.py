"""Which engine core (data-parallel replica) serves a request: the one with the fewest outstanding
tokens, where a prompt's leading blocks that a replica has seen recently count as tokens it will not
have to compute (its prefix cache likely holds them), so a shared prefix goes back where it is cached
unless that replica is busier by more than the prefix saves.

Outstanding tokens of a request: its prompt plus n x max_tokens, less the tokens made so far.
"""
from collections import OrderedDict

MAX_PREFIX_BLOCKS = 64  # leading blocks of a prompt remembered per request
MAX_REMEMBERED = 1 << 14  # block hashes remembered per replica (least recently used dropped)


class Router:
    def __init__(self, num_replicas: int, block_size: int):
        self.block_size = block_size
        self.load = [0] * num_replicas
        self.seen: list[OrderedDict] = [OrderedDict() for _ in range(num_replicas)]
        self.requests: dict[str, list] = {}  # request id -> [replica, outstanding tokens]
        self.served = [0] * num_replicas  # requests sent to each

    def block_hashes(self, prompt_ids: list[int]) -> list[int]:
        """Chained hashes of the prompt's full leading blocks (a block's hash covers all before it)."""
        hashes, h, b = [], 0, self.block_size
        for i in range(0, min(len(prompt_ids) // b, MAX_PREFIX_BLOCKS) * b, b):
            h = hash((h, tuple(prompt_ids[i:i + b])))
            hashes.append(h)
        return hashes

    def pick(self, prompt_ids: list[int], alive: list[bool]) -> int:
        hashes = self.block_hashes(prompt_ids)
        best, best_score = None, None
        for r, ok in enumerate(alive):
            if not ok:
                continue
            seen, cached = self.seen[r], 0
            for h in hashes:
                if h not in seen:
                    break
                cached += 1
            score = self.load[r] - cached * self.block_size
            if best_score is None or score < best_score:
                best, best_score = r, score
        assert best is not None, "no live replica"
        return best

    def add(self, request_id: str, replica: int, prompt_ids: list[int], tokens: int) -> None:
        self.requests[request_id] = [replica, tokens]
        self.load[replica] += tokens
        self.served[replica] += 1
        seen = self.seen[replica]
        for h in self.block_hashes(prompt_ids):
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > MAX_REMEMBERED:
            seen.popitem(last=False)

    def progress(self, request_id: str, tokens: int) -> None:
        entry = self.requests.get(request_id)
        if entry is not None:
            done = min(tokens, entry[1])
            entry[1] -= done
            self.load[entry[0]] -= done

    def remove(self, request_id: str) -> None:
        entry = self.requests.pop(request_id, None)
        if entry is not None:
            self.load[entry[0]] -= entry[1]

    def forget(self, replica: int) -> None:
        """A replica died (or restarted): its cache is gone."""
        self.seen[replica].clear()
