"""Rejection sampling: at most one passing trajectory per input, the rest dropped and counted."""
import pytest

from livemoe.train.judges import Verdict
from livemoe.train.selection import EmptySelectionError, require_nonempty, select

OK, WRONG, UNHELPFUL = Verdict(True, True), Verdict(False, True), Verdict(True, False)


def recs(n):
    return [{"id": str(i), "question": f"q{i}"} for i in range(n)]


def test_keeps_one_passing_per_input_and_counts_the_rest():
    cands = [["a0", "a1", "a2"], ["b0", "b1", "b2"], ["c0", "c1", "c2"]]
    verds = [[WRONG, OK, OK], [WRONG, UNHELPFUL, WRONG], [OK, WRONG, Verdict(False, False, unparseable=True)]]
    kept, st = select(recs(3), cands, verds)
    assert [(k["id"], k["completion"], k["candidate_index"]) for k in kept] == [("0", "a1", 1), ("2", "c0", 0)]
    assert (st.inputs, st.candidates, st.kept, st.dropped) == (3, 9, 2, 1)
    assert (st.correct, st.helpful, st.both, st.unparseable) == (4, 7, 3, 1)
    assert kept[0]["verdict"]["correct"] and kept[0]["question"] == "q0"


def test_policies():
    cands = [["long answer here", "short", "mid one"]]
    verds = [[OK, OK, OK]]
    assert select(recs(1), cands, verds, "first")[0][0]["completion"] == "long answer here"
    assert select(recs(1), cands, verds, "shortest")[0][0]["completion"] == "short"
    picks = {select(recs(1), cands, verds, "random", seed=s)[0][0]["candidate_index"] for s in range(20)}
    assert picks == {0, 1, 2}
    assert select(recs(1), cands, verds, "random", seed=3) == select(recs(1), cands, verds, "random", seed=3)
    with pytest.raises(ValueError, match="selection policy"):
        select(recs(1), cands, verds, "best")


def test_empty_selection_is_a_clear_error():
    kept, st = select(recs(2), [["a"], ["b"]], [[WRONG], [UNHELPFUL]])
    assert kept == [] and st.dropped == 2
    with pytest.raises(EmptySelectionError, match="empty selection: none of 2 inputs"):
        require_nonempty(kept, st)


def test_mismatched_lengths():
    with pytest.raises(ValueError, match="2 records, 1 candidate lists"):
        select(recs(2), [["a"]], [[OK]])


def test_all_keeps_every_candidate_unfiltered_and_still_counts_the_verdicts():
    cands = [["a0", "a1"], ["b0", "b1"]]
    verds = [[WRONG, OK], [UNHELPFUL, WRONG]]
    kept, st = select(recs(2), cands, verds, "all")
    assert [(k["id"], k["completion"], k["candidate_index"]) for k in kept] == [
        ("0", "a0", 0), ("0", "a1", 1), ("1", "b0", 0), ("1", "b1", 1)]
    assert [k["verdict"]["correct"] for k in kept] == [False, True, True, False]
    assert (st.inputs, st.candidates, st.kept, st.dropped, st.both) == (2, 4, 4, 0, 1)
