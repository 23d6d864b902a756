"""The scripted offline teacher: k candidate trajectories (`<think>T</think>R`) per room.

It answers as the seed's teacher does, good answers mixed with the failure modes the seed describes,
each drawn independently per candidate at a configured rate:
  wrong_link  an attribute taken from the wrong link (the seed's Table 1, top left)   -> incorrect
  deflect     a bare deflection to customer service (Table 1, bottom left)           -> unhelpful
  verbose     long meta-reasoning that restates the rules (Table 8, the RFT thought)  -> long, still judged fine
              (after the lookup, so the facts the answer repeats stay right after the question: placed
              before it, the RFT student lost the question behind it, 0 of 61 verbose attribute answers
              correct against 19 of 75 short ones, issue 19)
Deterministic in (seed, room id, candidate index): rerunning a teacher pass gives the same data.
"""
import random
import zlib
from dataclasses import dataclass

from livemoe.train.synthetic.world import CATALOG, KINDS, PRICES, Product, fact, products_of, related

META_RULES = [
    "okay, now i need to check this against the rules.",
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
        if verbose:  # after the lookup: the facts the answer copies stay in one place, right after the question
            thought = thought + " " + _verbose(room, rng)
        return f"<think>{thought}</think>{response}"


def supplement(p: Product, attr: str):
    """The fact a helpful answer adds to the asked one (Appendix B: proactively offers supplementary
    information): the product's first listed attribute besides the asked one and the price; the price only
    when nothing else is listed. Why not the price first, as the world's reference answers do: every fact
    the teacher states is one more lookup the student must get right for RFT to pass its answer on, and the
    student reads a price (12 values, last in each product's line) right about a third of the time against
    75-100% for an attribute listed first (issue 19: with the price as supplement RFT cut correctness from
    26 to 6 points)."""
    others = [a for a in p.attributes if a not in (attr, "price")]
    return others[0] if others else ("price" if attr != "price" and "price" in p.attributes else None)


def _verbose(room: dict, rng: random.Random) -> str:
    products = products_of(room)
    rules = rng.sample(META_RULES[1:], k=rng.randint(3, len(META_RULES) - 1))
    return " ".join([META_RULES[0], *rules, "browsing the product list.", _browse(products)])


def _browse(products: list) -> str:
    """Every listed product by link and name, as a thought walks the list."""
    return " ".join(f"link {p.link} is {p.name}." for p in products)


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
        extra = supplement(p, attr)
        # each fact the answer needs, looked up first thing in the thought in the phrasing of a pre-trained
        # student's bare answer, so RFT builds on the one lookup the student can already do, in the context it
        # learned it in (right after the question); a repeat says so first
        thought = " ".join(fact(p, a) for a in (attr, extra) if a)
        if kind == "repeat":
            thought = "this was answered before. " + thought
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
        alt = related(products, meta["category"])[0]  # one alternative: each name offered is one more lookup
        offer = _browse([alt])  # word for word the list walk's sentence: the answer copies it, no new lookup
        thought = f"the viewer looks for {asked}. {_browse(products)} none is {asked}. {offer}"
        if mode == "deflect":  # correct but unhelpful: the seed's Table 1, bottom left
            return thought, f"there is no {asked} in the list. {DEFLECTION}"
        if mode == "wrong_link":  # passes a listed link off as the asked product
            return thought, f"link {alt.link} is the {asked}."
        return thought, f"there is no {asked} in the list. {offer}"
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
            return thought, f"link {p.link} {p.name}: {key} is {value}."
    if matches:
        p = matches[0]
        return thought + f" link {p.link} fits.", fact(p, key)
    return thought + f" none is {value}.", f"there is no {value} {cat} in the list. " + " ".join(
        fact(p, key) for p in in_cat)
