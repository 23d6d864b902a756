"""Rejection sampling (the seed's section 4.1): keep at most one trajectory per input that is judged
both correct and helpful; inputs with none are dropped and counted. Policy `all` is the seed's Table 4
baseline instead: plain SFT on every teacher sample, judged (for the counts) but not filtered."""
import random
from dataclasses import asdict, dataclass


class EmptySelectionError(ValueError):
    """No input kept a trajectory: nothing to fine-tune on."""


@dataclass
class SelectionStats:
    inputs: int = 0
    candidates: int = 0
    correct: int = 0
    helpful: int = 0
    both: int = 0
    kept: int = 0
    dropped: int = 0
    unparseable: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


POLICIES = ("first", "random", "shortest", "all")


def select(records: list, candidates: list, verdicts: list, policy: str = "first", seed: int = 0) -> tuple:
    """records[i] with candidates[i][j] judged verdicts[i][j] -> (kept examples, SelectionStats).

    A kept example is the record plus "completion", "candidate_index" and "verdict". `policy` picks
    among an input's passing candidates: the first, a seeded random one, or the shortest; `all` keeps
    every candidate of every input, passing or not (no judge filtering).
    """
    if policy not in POLICIES:
        raise ValueError(f"selection policy must be one of {POLICIES}, got {policy!r}")
    if not len(records) == len(candidates) == len(verdicts):
        raise ValueError(f"{len(records)} records, {len(candidates)} candidate lists, {len(verdicts)} verdict lists")
    rng = random.Random(seed)
    stats, kept = SelectionStats(inputs=len(records)), []
    for rec, cands, verds in zip(records, candidates, verdicts):
        assert len(cands) == len(verds), (len(cands), len(verds))
        stats.candidates += len(cands)
        stats.correct += sum(v.correct for v in verds)
        stats.helpful += sum(v.helpful for v in verds)
        stats.unparseable += sum(v.unparseable for v in verds)
        passing = [j for j, v in enumerate(verds) if v.correct and v.helpful]
        stats.both += len(passing)
        if policy == "all":
            kept += [_example(rec, cands, verds, j) for j in range(len(cands))]
            continue
        if not passing:
            stats.dropped += 1
            continue
        j = {"first": lambda: passing[0], "random": lambda: rng.choice(passing),
             "shortest": lambda: min(passing, key=lambda i: len(cands[i]))}[policy]()
        kept.append(_example(rec, cands, verds, j))
    stats.kept = len(kept)
    return kept, stats


def _example(rec: dict, cands: list, verds: list, j: int) -> dict:
    v = verds[j]
    return {**rec, "completion": cands[j], "candidate_index": j,
            "verdict": {"correct": v.correct, "helpful": v.helpful, "reason": v.reason}}


def require_nonempty(kept: list, stats: SelectionStats) -> None:
    if not kept:
        raise EmptySelectionError(
            f"empty selection: none of {stats.inputs} inputs has a trajectory judged both correct and helpful "
            f"({stats.candidates} candidates: {stats.correct} correct, {stats.helpful} helpful, "
            f"{stats.unparseable} unparseable verdicts). Check the teacher and the judge, or raise --k.")
