"""The scripted offline teacher: k candidate trajectories (`<think>T</think>R`) per room.

It answers as the seed's teacher does, good answers mixed with the failure modes the seed describes,
each drawn independently per candidate at a configured rate:
  wrong_link  an attribute taken from the wrong link (the seed's Table 1, top left)   -> incorrect
  deflect     a bare deflection to customer service (Table 1, bottom left)           -> unhelpful
  verbose     long meta-reasoning that restates the rules (Table 8, the RFT thought)  -> long, still judged fine
Deterministic in (seed, room id, candidate index): rerunning a teacher pass gives the same data.
"""
import random
import zlib
from dataclasses import dataclass

from train.synthetic.world import CATALOG, KINDS, PRICES, Product, fact, products_of, related

META_RULES = [
    "okay, i need to process the viewer question.",
    "first i must check the product information.",
    "the rules say the response must not exceed the product information.",
    "the rules say i must not send the viewer to customer service without any help.",
    "the rules say a repeated question must be pointed out.",
    "i need to quote the viewer question and keep a friendly tone.",
]
DEFLECTION = "please ask customer service about it."
MODES = ("good", "wrong_link", "deflect")


@dataclass(slots=True)
class TeacherRates:
    wrong_link: float = 0.25
    deflect: float = 0.2
    verbose: float = 0.6

    def __post_init__(self):
        for k in ("wrong_link", "deflect", "verbose"):
            if not 0.0 <= getattr(self, k) <= 1.0:
                raise ValueError(f"teacher rate {k}={getattr(self, k)} must be in [0, 1]")


class ScriptedTeacher:
    """`sample(rooms, k)` -> for each room a list of k completions (strings)."""

    def __init__(self, rates: TeacherRates | None = None, seed: int = 0):
        self.rates = rates or TeacherRates()
        self.seed = seed

    def sample(self, rooms: list, k: int = 4, temperature: float = 0.7) -> list:
        del temperature  # a script has no temperature; the failure rates play its part
        for room in rooms:
            if room.get("meta", {}).get("kind") not in KINDS:
                raise ValueError(f"input {room.get('id')!r} is not a room of the synthetic world: the scripted "
                                 "teacher cannot answer it; use --teacher URL or --teacher CHECKPOINT_DIR")
        return [[self.answer(room, j) for j in range(k)] for room in rooms]

    def answer(self, room: dict, j: int, mode: str | None = None, verbose: bool | None = None) -> str:
        """Candidate j; `mode` ("good" | "wrong_link" | "deflect") and `verbose` override the draws."""
        rng = random.Random(zlib.crc32(f"{self.seed}/{room['id']}/{j}".encode()))
        u, v = rng.random(), rng.random()
        if mode is None:
            mode = "wrong_link" if u < self.rates.wrong_link else (
                "deflect" if u < self.rates.wrong_link + self.rates.deflect else "good")
        assert mode in MODES, mode
        if verbose is None:
            verbose = v < self.rates.verbose
        thought, response = _compose(room, mode, rng)
        if verbose:
            thought = _verbose(room, rng) + " " + thought
        return f"<think>{thought}</think>{response}"


def _verbose(room: dict, rng: random.Random) -> str:
    products = products_of(room)
    rules = rng.sample(META_RULES[1:], k=rng.randint(3, len(META_RULES) - 1))
    browse = " ".join(f"link {p.link} is {p.name}." for p in products)
    return " ".join([META_RULES[0], *rules, "browsing the product list.", browse])


def _wrong_value(products: list, p: Product, attr: str, rng: random.Random) -> str:
    """A value of `attr` that belongs to another link (or, failing that, any other value)."""
    others = [q.attributes[attr] for q in products if q is not p and attr in q.attributes
              and q.attributes[attr] != p.attributes[attr]]
    if not others:
        vals = CATALOG[p.category]["attrs"].get(attr) if attr != "price" else None
        others = [v for v in (vals or PRICES) if v != p.attributes[attr]]
    return rng.choice(others)


def _compose(room: dict, mode: str, rng: random.Random) -> tuple:
    products = products_of(room)
    by_link = {p.link: p for p in products}
    meta = room["meta"]
    kind = meta["kind"]
    if kind in ("attribute", "repeat"):
        p, attr = by_link[meta["link"]], meta["attribute"]
        extra = next((a for a in ("price", *p.attributes) if a != attr and a in p.attributes), None)
        # each fact the answer needs, looked up in the thought in the phrasing of a pre-trained student's bare
        # answer right after the question it answers, so RFT builds on the one lookup the student can already do
        asked = f"link {p.link}" if f"link {p.link}" in room["question"] else f"the {p.name}"
        thought = f"the viewer asks the {attr} of {asked}. " + " ".join(fact(p, a) for a in (attr, extra) if a)
        if kind == "repeat":
            thought += " this was answered before."
        if mode == "deflect":
            return thought, DEFLECTION
        value = _wrong_value(products, p, attr, rng) if mode == "wrong_link" else p.attributes[attr]
        response = f"link {p.link} {p.name}: {attr} is {value}."
        if extra:
            response += f" {extra} is {p.attributes[extra]}."
        if kind == "repeat":
            response = "as said before, " + response
        return thought, response
    if kind == "missing":
        asked = meta["name"]
        alts = related(products, meta["category"])[:2]
        thought = f"the viewer looks for {asked}. " + " ".join(f"link {p.link} is {p.name}." for p in products) \
            + f" none is {asked}. " + " ".join(fact(a, "price") for a in alts)
        if mode == "deflect":  # correct but unhelpful: the seed's Table 1, bottom left
            return thought, f"there is no {asked} in the list. {DEFLECTION}"
        if mode == "wrong_link":  # passes a listed link off as the asked product
            p = alts[0]
            return thought, f"link {p.link} {asked}: price is {p.attributes['price']}."
        return thought, f"there is no {asked} in the list. " + " ".join(fact(a, "price") for a in alts)
    # recommend
    cat, key, value = meta["category"], meta["attribute"], meta["value"]
    in_cat = [p for p in products if p.category == cat]
    thought = f"the viewer wants a {cat} with {key} {value}. " + " ".join(fact(p, key) for p in in_cat)
    if mode == "deflect":
        return thought, DEFLECTION
    matches = [p for p in in_cat if p.link in meta["matches"]]
    if mode == "wrong_link":  # claims a product has the wanted value when it does not (or another link)
        wrong = [p for p in in_cat if p not in matches] or [p for p in products if p not in matches]
        if wrong:
            p = rng.choice(wrong)
            return thought, f"link {p.link} {p.name}: {key} is {value}. price is {p.attributes['price']}."
    if matches:
        p = matches[0]
        return thought + f" link {p.link} fits. {fact(p, 'price')}", fact(p, key) + " " + fact(p, "price")
    return thought + f" none is {value}.", f"there is no {value} {cat} in the list. " + " ".join(
        fact(p, key) for p in in_cat)
