"""Scheduler: continuous batching with chunked prefill and preemption by recompute.

Each step gets a token budget (max_num_batched_tokens). Running sequences go first, in arrival order:
a decode takes one token, an unfinished prefill takes the next chunk that fits. What budget is left
admits waiting sequences (their first chunk), so a long prompt is spread over several steps while the
streams already in flight keep decoding. When blocks run out, the most recently admitted running
sequence is preempted: its blocks are freed (keeping their prefix-cache hashes) and it is recomputed
later from its tokens. The scheduler never touches a tensor.

Fairness between requests: a request may keep at most `max_running_seqs_per_request` sequences running
while another request's sequences wait. Waiting sequences of requests under that share are admitted
first, and when every seat is taken, the newest sequences of requests over it are preempted to seat
them. A request alone (nothing else waiting) still fills every seat.
"""
from collections import Counter, deque
from dataclasses import dataclass, field

from livemoe.engine.decoder.block_manager import BlockManager
from livemoe.engine.decoder.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)  # tokens each seq computes this step

    def __len__(self) -> int:
        return len(self.seqs)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_decode_only(self) -> bool:
        return sum(self.num_new_tokens) == len(self.num_new_tokens)  # every seq computes >= 1 token


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_running_seqs_per_request: int | None = None):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.share = max_running_seqs_per_request or max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        assert seq.status == SequenceStatus.WAITING and not seq.block_table, seq
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        preempted = False
        running_of = self._yield_seats() if self.waiting and self.share < self.max_num_seqs else None
        i = 0
        running, bm = self.running, self.block_manager
        while i < len(running) and budget > 0:
            seq = running[i]
            n = min(len(seq.token_ids) - seq.num_computed_tokens, budget)
            assert n > 0, seq
            if seq.num_draft_tokens > n - 1:  # speculative drafts are verified whole with their token: keep those that fit
                self._drop_drafts(seq, keep=n - 1)
            while not bm.try_append_slots(seq, n):
                if seq.num_draft_tokens:  # drafts never cost a preemption
                    self._drop_drafts(seq)
                    n = 1
                    continue
                victim = running.pop()  # the newest; never one scheduled already (those are < i)
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            break
        for seq in running[i:]:  # not scheduled this step: drafts are only ever verified in the step that made them
            if seq.num_draft_tokens:
                self._drop_drafts(seq)
        # admitting new work right after a preemption would only thrash
        # requests under their share first (in arrival order), then the queue's front
        fair = deque(self._under_share(running_of)) if running_of is not None and not preempted else deque()
        num_fair_admitted = 0  # each one admitted shifts the later positions by one
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            k = fair[0] - num_fair_admitted if fair else 0
            seq = self.waiting[k]
            n = self.block_manager.allocate(seq, budget)
            if n == 0:
                break
            del self.waiting[k]
            if fair:
                fair.popleft()
                num_fair_admitted += 1
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_new_tokens.append(n)
            budget -= n
        return out

    def _under_share(self, running_of: Counter) -> list[int]:
        """Positions (ascending) in `waiting` of the sequences whose request runs fewer than its share,
        counting those found before them; at most max_num_seqs (seats to fill)."""
        found: list[int] = []
        counts: Counter[str] = Counter()
        for k, seq in enumerate(self.waiting):
            rid = seq.request_id
            if running_of[rid] + counts[rid] < self.share:
                found.append(k)
                counts[rid] += 1
                if len(found) >= self.max_num_seqs:
                    break
        return found

    def _yield_seats(self) -> Counter:
        """Preempts sequences of requests over their share while every seat is taken and sequences of
        requests under it wait. Returns the running sequences per request."""
        running_of = Counter(seq.request_id for seq in self.running)
        if len(self.running) < self.max_num_seqs or not any(c > self.share for c in running_of.values()):
            return running_of
        for _ in self._under_share(running_of):
            rid, count = running_of.most_common(1)[0]
            if count <= self.share:
                break
            victim = next(seq for seq in reversed(self.running) if seq.request_id == rid)
            self.running.remove(victim)
            self._preempt(victim)
            running_of[rid] -= 1
        return running_of

    def _drop_drafts(self, seq: Sequence, keep: int = 0) -> None:
        """Drafts past `keep` leave the sequence, and the blocks taken for their slots (a draft model's proposal
        takes them ahead) go back."""
        seq.drop_drafts(keep)
        self.block_manager.trim(seq)

    def preempt_all(self) -> None:
        """Every running sequence back to the front of the queue, in its running order, to be recomputed (the
        weights changed under it: in_flight="interrupt")."""
        for seq in reversed(self.running):
            self._preempt(seq)
        self.running = []

    def _preempt(self, seq: Sequence) -> None:
        seq.drop_drafts()  # it is recomputed from its committed tokens
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def update_computed(self, out: SchedulerOutput) -> list[bool]:
        """After the step ran: marks the computed tokens and says which seqs reached their end (and so
        sampled a token)."""
        sampled = []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            seq.num_computed_tokens = computed = seq.num_computed_tokens + n
            assert computed <= len(seq.token_ids), seq
            sampled.append(computed == len(seq.token_ids))
        return sampled

    def finish(self, seq: Sequence) -> None:
        """Frees a finished or aborted seq, wherever it is."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass  # not yet added
        if seq.block_table:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
