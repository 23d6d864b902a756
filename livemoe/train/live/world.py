"""A seeded livestream world: a host sells the RFT default's commerce-room products over a session of
10-second intervals, and written rules say what the assistant should decide in each.

Products, attributes, prices and fact phrasing come from livemoe.train.synthetic.world (the RFT default's
rooms), plus a stock attribute. In each interval, at random (`LiveWorldConfig` rates): viewers join,
ask about a product (an attribute, the price, the stock, the link; sometimes again), chat among
themselves, send gifts or make a wrong claim about a price; the host talks about a product, answers a
question asked this interval, or announces a change (a new price, a stock-out); a frame caption says
what is on screen; room metadata counts viewers.

The ground-truth decision of an interval, by rule, first that applies:
  1. MEM     the host announced a change: the note is the new fact
  2. ANS     a question stands unanswered (asked and not answered by the host in its interval, not yet
             answered by the assistant): the oldest one, task answer, the current fact
  3. ANS     a viewer claimed a wrong fact this interval: task correct, the current fact
  4. ANS     a viewer sent a gift this interval: task thank
  5. ANS     a viewer joined this interval: task welcome
  6. OBS     otherwise (most intervals)
A question passed over (by a MEM or an older question) stands to the next interval; a claim, gift or
join is owed only in its own interval.

The recorded trajectory (what MA-MSFT imitates) is not the reviewed one. The seed trains on sessions its
trajectory engine reconstructs from real streams and scores on a human-reviewed benchmark: the
reconstruction shows what the stream's assistant did, and real assistants skip many courtesy replies. So an
interval whose reviewed decision is a welcome or a thank is recorded as OBS with probability
`p_unrecorded_courtesy` (the interval's `recorded` decision; its own random stream, so the sessions' events
and reviewed decisions do not depend on it). The judge, the held-out accuracies and SM-GSPO's rewards use
the reviewed `decision`; what the recording leaves out only the reward can teach.

A session is a plain dict (the JSONL trajectory format of `--data`, see livemoe/train/live/data.py). Same
seed, same sessions.
"""
import random
from dataclasses import dataclass

from livemoe.engine.live.decision import format_decision
from livemoe.train.synthetic.world import CATALOG, PRICES, Product, make_product, fact

VIEWERS = ("amy", "bob", "carl", "dina", "ed", "fay", "gus", "hana", "ivan", "june", "kai", "lily", "max",
           "nora", "omar", "pia", "quin", "rosa", "sam", "tina")
GIFTS = ("rose", "rocket", "heart", "star", "cake")
CHATTER = ("haha", "nice stream", "hello everyone", "so cheap", "i like this one", "wow", "good evening",
           "lol", "me too", "waiting for the next one")
STOCK = ("in stock", "sold out")
SYSTEM = ("live assistant of a shopping stream. each interval: OBS (silent), MEM <changed fact>, or "
          "ANS @<viewer> <answer|correct|thank|welcome>: <message>. products:")


@dataclass(kw_only=True)
class LiveWorldConfig:
    num_intervals: int = 12
    interval_s: int = 10
    num_products: tuple = (3, 4)  # inclusive range
    max_link: int = 40
    p_join: float = 0.10
    p_question: float = 0.25
    p_host_answers: float = 0.4  # the host answers a question in the interval it was asked
    p_repeat: float = 0.2  # a question is one asked before
    p_claim: float = 0.05
    p_gift: float = 0.08
    p_change: float = 0.07
    p_chatter: float = 0.5
    p_host_talk: float = 0.5
    p_frame: float = 0.4
    p_meta: float = 0.1
    p_unrecorded_courtesy: float = 0.5  # a welcome or thank the recorded trajectory leaves out (OBS)

    def __post_init__(self):
        for name, value in vars(self).items():
            if name.startswith("p_") and not 0.0 <= value <= 1.0:
                raise ValueError(f"LiveWorldConfig.{name} must be in [0, 1], got {value!r}")
        if self.num_intervals < 1 or self.interval_s <= 0:
            raise ValueError("LiveWorldConfig: num_intervals must be >= 1 and interval_s > 0")


def render_products(products: list) -> str:
    lines = []
    for p in products:
        attrs = " ".join(f"{a}: {v}." for a, v in p.attributes.items())
        lines.append(f"link {p.link}: {p.name}. {attrs}")
    return "\n".join(lines)


def system_prompt(products: list) -> str:
    return SYSTEM + "\n" + render_products(products)


def answer_fact(p: Product, attr: str) -> str:
    """The fact that answers a question about attr of p (the judge looks for it in the message)."""
    if attr == "link":
        return f"the {p.name} is link {p.link}."
    return fact(p, attr)


def question_text(rng: random.Random, p: Product, attr: str) -> str:
    if attr == "link":
        return rng.choice([f"which link is the {p.name}?", f"where is the {p.name}?"])
    if attr == "stock":
        return rng.choice([f"is the {p.name} still in stock?", f"is link {p.link} sold out?"])
    if attr == "price":
        return rng.choice([f"how much is the {p.name}?", f"what is the price of link {p.link}?"])
    return rng.choice([f"what is the {attr} of the {p.name}?", f"what is the {attr} of link {p.link}?"])


def _products(rng: random.Random, cfg: LiveWorldConfig) -> list:
    cat = rng.sample(sorted(CATALOG), k=2)
    pool = [nm for c in cat for nm in CATALOG[c]["names"]]
    names = rng.sample(pool, k=min(rng.randint(*cfg.num_products), len(pool)))
    links = sorted(rng.sample(range(1, cfg.max_link + 1), k=len(names)))
    products = [make_product(rng, nm, ln) for nm, ln in zip(names, links)]
    for p in products:
        p.attributes["stock"] = "in stock"
    return products


class Referee:
    """The written rules (see the module docstring) over the room's state and the standing questions.
    `ask` queues a question the host left unanswered; `decide` gives an interval's gold decision."""

    def __init__(self, room: dict):
        self.room = room  # link -> Product, changed in place as the host announces changes
        self.pending: list = []  # [(user, link, attribute)], oldest first

    def ask(self, user: str, link: int, attribute: str) -> None:
        self.pending.append((user, link, attribute))

    def decide(self, changes: list, claim=None, gift=None, join=None) -> tuple:
        """changes: this interval's [{"link", "attribute", "value"}] (already applied to the room);
        claim: (user, link) of a wrong price claim; gift: (user, gift); join: a user. -> (decision, facts)."""
        if changes:
            c = changes[-1]
            note = fact(self.room[c["link"]], c["attribute"])
            return _decision("MEM", message=note), [note]
        if self.pending:
            user, link, attr = self.pending.pop(0)
            current = answer_fact(self.room[link], attr)  # the fact may have changed since it was asked
            return _decision("ANS", user, "answer", current), [current]
        if claim:
            user, link = claim
            truth = fact(self.room[link], "price")
            return _decision("ANS", user, "correct", f"not quite. {truth}"), [truth]
        if gift:
            user, what = gift
            return _decision("ANS", user, "thank", f"thank you for the {what}, {user}!"), [user, what]
        if join:
            return _decision("ANS", join, "welcome", f"welcome, {join}!"), [join]
        return _decision("OBS"), []


def _decision(kind, recipient=None, task=None, message=None) -> dict:
    return {"kind": kind, "recipient": recipient, "task": task, "message": message}


def make_session(rng: random.Random, cfg: LiveWorldConfig, session_id: str) -> dict:
    products = _products(rng, cfg)
    system = system_prompt(products)
    state = {p.link: Product(p.link, p.name, p.category, dict(p.attributes)) for p in products}
    present: list = []  # viewers in the room
    asked_before: list = []  # (link, attr) asked earlier: repeats come from here
    referee = Referee(state)
    recording = random.Random(f"{session_id}/recorded")  # apart: the events do not depend on the recording
    intervals = []
    for i in range(cfg.num_intervals):
        events, changes, questions = [], [], []
        claim = gift = join = None
        live = list(state.values())
        if rng.random() < cfg.p_meta:
            events.append({"type": "meta", "text": f"viewers {rng.randint(20, 400)}."})
        if rng.random() < cfg.p_frame:
            p = rng.choice(live)
            events.append({"type": "frame", "text": f"the host holds up the {p.name}."})
        if not present or rng.random() < cfg.p_join:
            absent = [v for v in VIEWERS if v not in present]
            if absent:
                join = rng.choice(absent)
                present.append(join)
                events.append({"type": "join", "user": join})
        if rng.random() < cfg.p_host_talk:
            p = rng.choice(live)
            attr = rng.choice(sorted(p.attributes))
            events.append({"type": "transcript", "user": "host", "text": f"look at this one. {fact(p, attr)}"})
        if rng.random() < cfg.p_change:
            p = rng.choice(live)
            if p.attributes["stock"] == "in stock" and rng.random() < 0.4:
                attr, value = "stock", "sold out"
            else:
                attr, value = "price", rng.choice([x for x in PRICES if x != p.attributes["price"]])
            p.attributes[attr] = value
            changes.append({"link": p.link, "attribute": attr, "value": value})
            events.append({"type": "transcript", "user": "host", "text": f"news! {fact(p, attr)}"})
        if rng.random() < cfg.p_chatter and len(present) > 0:
            events.append({"type": "comment", "user": rng.choice(present), "text": rng.choice(CHATTER)})
        if rng.random() < cfg.p_question:
            asker = rng.choice(present)
            if asked_before and rng.random() < cfg.p_repeat:
                link, attr = rng.choice(asked_before)
                p = state[link]
            else:
                p = rng.choice(live)
                attr = rng.choice(sorted(p.attributes) + ["link"])
            asked_before.append((p.link, attr))
            events.append({"type": "comment", "user": asker, "text": question_text(rng, p, attr)})
            q = {"user": asker, "link": p.link, "attribute": attr, "fact": answer_fact(p, attr)}
            if rng.random() < cfg.p_host_answers:
                events.append({"type": "transcript", "user": "host", "text": f"@{asker} {q['fact']}"})
            else:
                referee.ask(q["user"], q["link"], q["attribute"])
                questions.append({"user": asker, "fact": q["fact"]})
        if rng.random() < cfg.p_claim:
            claim = rng.choice(present)
            p = rng.choice(live)
            wrong = rng.choice([x for x in PRICES if x != p.attributes["price"]])
            events.append({"type": "comment", "user": claim, "text": f"link {p.link} is only {wrong} right?"})
            claim = (claim, p.link)
        if rng.random() < cfg.p_gift:
            gift = (rng.choice(present), rng.choice(GIFTS))
            events.append({"type": "gift", "user": gift[0], "text": gift[1]})

        decision, facts = referee.decide(changes, claim, gift, join)
        intervals.append({"t": (i + 1) * cfg.interval_s, "events": events, "changes": changes,
                          "questions": questions,
                          "decision": decision, "facts": facts})
        if decision["task"] in ("welcome", "thank") and recording.random() < cfg.p_unrecorded_courtesy:
            intervals[-1]["recorded"] = _decision("OBS")
    return {"id": session_id, "system": system, "products": [p.to_json() for p in products], "intervals": intervals}


def make_sessions(n: int, seed: int = 0, cfg: LiveWorldConfig | None = None, prefix: str = "live") -> list:
    """n sessions, a pure function of (n, seed, cfg)."""
    rng = random.Random(f"live/{seed}")
    cfg = cfg or LiveWorldConfig()
    return [make_session(rng, cfg, f"{prefix}-{seed}-{i}") for i in range(n)]


def recorded_decision(interval: dict) -> dict:
    """The decision the recorded trajectory shows (MA-MSFT imitates it): `recorded` where the recording
    differs from the reviewed decision, else the decision."""
    return interval.get("recorded") or interval["decision"]


def decision_text(interval: dict, recorded: bool = False) -> str:
    """The reviewed decision's text (recorded=True: the recorded trajectory's)."""
    d = recorded_decision(interval) if recorded else interval["decision"]
    return format_decision(d["kind"], d.get("recipient"), d.get("task"), d.get("message"))
