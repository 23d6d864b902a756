"""The rule judge of live decisions: per interval state, recipient, task and grounding; per session the
trajectory-level terms SM-GSPO credits (questions answered in time, no spam, no contradiction of MEM).

Per interval, against the ground truth (`interval["decision"]`, `interval["facts"]`):
  state      the predicted kind equals the gold kind (OBS / MEM / ANS)
  recipient  gold ANS only: the prediction is an ANS to the gold recipient
  task       gold ANS only: the prediction is an ANS for the gold task (whoever it addresses)
  grounding  gold MEM / ANS only: the prediction has the gold kind, its text holds every gold fact, and
             every "link N name: attribute is value." it states is true in the room at that interval
             (when the session lists its products; changes apply from their interval on)
Accuracies (the seed's table): state over all intervals, recipient and task over gold-ANS intervals.

A prediction that does not parse counts as wrong on every field (it is kept as `None`).
"""
import math
import re
from dataclasses import dataclass, field

from livemoe.engine.live.decision import Decision

FACT_CLAUSE = re.compile(r"link (\d+) ([a-z ]+?): ([a-z ]+?) is (.+?)\.(?=\s|$)")


def room_states(session: dict) -> list:
    """Per interval {link: {"name", attribute: value}} as it stands after that interval's changes
    (None for a session without products)."""
    if not session.get("products"):
        return [None] * len(session["intervals"])
    room = {p["link"]: {"name": p["name"], **p["attributes"]} for p in session["products"]}
    states = []
    for iv in session["intervals"]:
        for c in iv.get("changes", []):
            room[c["link"]][c["attribute"]] = c["value"]
        states.append({k: dict(v) for k, v in room.items()})
    return states


def false_claims(text: str, state: dict | None) -> list:
    """The fact clauses of text that the room contradicts (an unknown link or attribute is false)."""
    if state is None or not text:
        return []
    bad = []
    for m in FACT_CLAUSE.finditer(text):
        link, name, attr, value = int(m.group(1)), m.group(2), m.group(3), m.group(4)
        p = state.get(link)
        if p is None or p["name"] != name or p.get(attr) != value:
            bad.append(m.group(0))
    return bad


@dataclass(slots=True)
class IntervalScore:
    state: bool
    recipient: bool | None  # None: the gold decision is not an ANS
    task: bool | None
    grounding: bool | None  # None: gold OBS

    def reward(self, weights=(0.4, 0.2, 0.2, 0.2)) -> float:
        """The turn-level reward: weighted state, recipient, task, grounding (fields that do not apply
        count as right when the state is right)."""
        parts = [self.state] + [self.state if x is None else x for x in (self.recipient, self.task, self.grounding)]
        return sum(w * float(p) for w, p in zip(weights, parts))


def score_interval(pred: Decision | None, interval: dict, state: dict | None = None) -> IntervalScore:
    gold = interval["decision"]
    kind = gold["kind"]
    ok_state = pred is not None and pred.kind == kind
    recipient = task = grounding = None
    if kind == "ANS":
        recipient = ok_state and pred.recipient == gold["recipient"]
        task = ok_state and pred.task == gold["task"]
    if kind in ("ANS", "MEM"):
        text = (pred.message or "") if ok_state else ""
        grounding = (ok_state and all(f in text for f in interval.get("facts", []))
                     and not false_claims(text, state))
    return IntervalScore(ok_state, recipient, task, grounding)


@dataclass
class SessionScore:
    intervals: list = field(default_factory=list)  # IntervalScore per interval
    answered_in_time: float = 1.0  # fraction of standing questions answered within `deadline` intervals
    spam: int = 0  # ANS where the gold decision is OBS
    contradictions: int = 0  # messages stating a fact the room (after a change) contradicts

    def trajectory_reward(self, num_intervals: int) -> float:
        """In [0, 1]: answered in time, minus spam and contradictions per interval."""
        penalty = (self.spam + self.contradictions) / max(1, num_intervals)
        return max(0.0, self.answered_in_time - penalty)


def score_session(preds: list, session: dict, deadline: int = 2) -> SessionScore:
    """preds: one Decision (or None, unparsable) per interval of the session."""
    intervals = session["intervals"]
    if len(preds) != len(intervals):
        raise ValueError(f"{len(preds)} decisions for a session of {len(intervals)} intervals")
    states = room_states(session)
    out = SessionScore([score_interval(p, iv, s) for p, iv, s in zip(preds, intervals, states)])
    asked = answered = 0
    for i, iv in enumerate(intervals):
        for q in iv.get("questions", []):
            asked += 1
            window = preds[i:i + deadline + 1]
            answered += any(p is not None and p.kind == "ANS" and p.recipient == q["user"] and p.task == "answer"
                            for p in window)
    out.answered_in_time = answered / asked if asked else 1.0
    for p, iv, s in zip(preds, intervals, states):
        if p is None:
            continue
        if p.kind == "ANS" and iv["decision"]["kind"] == "OBS":
            out.spam += 1
        if p.message and false_claims(p.message, s):
            out.contradictions += 1
    return out


def outcomes(scores: list) -> dict:
    """Per accuracy the 0/1 outcome of each interval it is over, in order ("state": all intervals,
    "recipient" and "task": the gold-ANS ones): two stages judged on the same sessions pair up."""
    return {name: [int(getattr(s, name)) for s in scores if getattr(s, name) is not None]
            for name in ("state", "recipient", "task")}


def paired_margin(before: list, after: list) -> tuple:
    """(mean of after - before, its standard error), in % points, over paired 0/1 outcomes of the same
    intervals: the noise of a difference between two stages, smaller than either stage's own error when
    they get the same intervals right."""
    if len(before) != len(after) or not before:
        raise ValueError(f"paired outcomes need the same non-zero length, got {len(before)} and {len(after)}")
    d = [b - a for a, b in zip(before, after)]
    n = len(d)
    mean = sum(d) / n
    var = sum((x - mean) ** 2 for x in d) / (n - 1) if n > 1 else 0.0
    return 100.0 * mean, 100.0 * math.sqrt(var / n)


def accuracy(scores: list) -> dict:
    """The seed's table over IntervalScores: state, recipient and task accuracy (%) and grounding, each
    with its binomial standard error (`<name>_se`, % points: 100 * sqrt(p (1 - p) / n)) and how many
    intervals it is over (`<name>_n`): one decision in n moves it by 100 / n points."""
    out = {}
    for name in ("state", "recipient", "task", "grounding"):
        xs = [getattr(s, name) for s in scores if getattr(s, name) is not None]
        p = sum(xs) / len(xs) if xs else 0.0
        out[name] = 100.0 * p
        out[f"{name}_se"] = 100.0 * math.sqrt(p * (1 - p) / len(xs)) if xs else 0.0
        out[f"{name}_n"] = len(xs)
    out["intervals"] = len(scores)
    return out
