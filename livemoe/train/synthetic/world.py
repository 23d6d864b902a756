"""A seeded world of live-stream commerce rooms: the embedded default data of `python -m train.rft`.

A room is the seed's input triple (its section 3.1): the retrieved product documents D (a product list
with link numbers and attributes), the viewer's question Q and the conversation history H, plus a
reference answer. Question kinds follow the seed's Tables 1 and 8:
  attribute  an attribute of a listed product        ("what is the filling of the pork zongzi?")
  missing    a product that is not listed             ("do you have a red bean zongzi?")
  recommend  a recommendation by a key attribute      ("recommend a cool only air conditioner.")
  repeat     a question already answered in H         (the answer must say so: Appendix B rule 9)

Everything is lower-case words from a small closed vocabulary, so the rule-based judge can check every
claim and a tiny student can learn the language in minutes. Same seed, same rooms.
"""
import random
from dataclasses import dataclass, field

PRICES = [f"{p} yuan" for p in (19, 29, 39, 49, 59, 69, 79, 89, 99, 129, 159, 199)]

# category -> product names, attributes (name -> values), the key attribute a viewer recommends by,
# and how that request reads.
CATALOG = {
    "zongzi": dict(
        names=["pork zongzi", "pork belly zongzi", "red bean zongzi", "egg yolk zongzi", "date zongzi",
               "zongzi gift box"],
        attrs={"filling": ["pork", "pork belly", "red bean", "egg yolk", "date", "mixed"],
               "weight": ["200 g", "500 g", "1 kg"]},
        key="filling", ask="recommend a zongzi with {value} filling."),
    "screen protector": dict(
        names=["glass protector", "matte protector", "privacy protector"],
        attrs={"fits": ["iphone 11", "iphone 12", "iphone 13", "iphone 14", "iphone 15"],
               "material": ["glass", "film"]},
        key="fits", ask="recommend a screen protector for {value}."),
    "phone case": dict(
        names=["leather case", "clear case", "silicone case"],
        attrs={"fits": ["iphone 11", "iphone 12", "iphone 13", "iphone 14", "iphone 15"],
               "color": ["red", "blue", "black", "white", "grey"]},
        key="color", ask="recommend a {value} phone case."),
    "air conditioner": dict(
        names=["gree air conditioner", "yunhuan air conditioner", "midea air conditioner"],
        attrs={"type": ["cool only", "cool and warm", "cool and warm with heater"],
               "power": ["1 hp", "1.5 hp", "2 hp"]},
        key="type", ask="recommend a {value} air conditioner."),
    "scarf": dict(
        names=["wool scarf", "silk scarf", "cotton scarf"],
        attrs={"color": ["red", "blue", "black", "white", "grey"], "length": ["150 cm", "180 cm", "200 cm"]},
        key="color", ask="recommend a {value} scarf."),
    "tea": dict(
        names=["green tea", "black tea", "oolong tea", "white tea"],
        attrs={"origin": ["yunnan", "fujian", "zhejiang", "anhui"], "weight": ["200 g", "500 g", "1 kg"]},
        key="origin", ask="recommend a tea from {value}."),
    "shoes": dict(
        names=["running shoes", "canvas shoes", "hiking boots"],
        attrs={"size": ["38", "39", "40", "41", "42"], "color": ["red", "blue", "black", "white", "grey"]},
        key="size", ask="recommend shoes in size {value}."),
}
KINDS = ("attribute", "missing", "recommend", "repeat")
ATTRIBUTES = sorted({a for c in CATALOG.values() for a in c["attrs"]} | {"price"})
PRODUCT_NAMES = sorted({n for c in CATALOG.values() for n in c["names"]})
CATEGORY_OF = {n: cat for cat, c in CATALOG.items() for n in c["names"]}


@dataclass(slots=True)
class Product:
    link: int
    name: str
    category: str
    attributes: dict  # attribute -> value, price included

    def to_json(self) -> dict:
        return {"link": self.link, "name": self.name, "category": self.category,
                "attributes": dict(self.attributes)}


@dataclass(slots=True)
class WorldConfig:
    num_products: tuple = (4, 6)  # inclusive range of products per room
    max_link: int = 40
    max_history: int = 2
    kind_weights: dict = field(default_factory=lambda: {"attribute": 0.4, "missing": 0.2,
                                                        "recommend": 0.2, "repeat": 0.2})


def render_product(p: Product) -> str:
    attrs = " ".join(f"{a}: {v}." for a, v in p.attributes.items())
    return f"link {p.link}: {p.name}. {attrs}"


def fact(p: Product, attr: str) -> str:
    """The one phrasing of a fact the judge and the teacher share."""
    return f"link {p.link} {p.name}: {attr} is {p.attributes[attr]}."


def attribute_question(rng: random.Random, p: Product, attr: str) -> str:
    return rng.choice([f"what is the {attr} of the {p.name}?", f"how about the {attr} of the {p.name}?",
                       f"what is the {attr} of link {p.link}?"])


def make_product(rng: random.Random, name: str, link: int) -> Product:
    cat = CATEGORY_OF[name]
    attrs = {a: rng.choice(vals) for a, vals in CATALOG[cat]["attrs"].items()}
    if cat == "zongzi" and name != "zongzi gift box":  # the name says the filling
        attrs["filling"] = name[: -len(" zongzi")]
    attrs["price"] = rng.choice(PRICES)
    return Product(link, name, cat, attrs)


def make_room(rng: random.Random, cfg: WorldConfig, room_id: str) -> dict:
    n = rng.randint(*cfg.num_products)
    # a few categories, several products each, so neighbours are easy to confuse (the seed's Table 1)
    cats = rng.sample(sorted(CATALOG), k=rng.randint(2, 3))
    pool = [nm for c in cats for nm in CATALOG[c]["names"]]
    names = rng.sample(pool, k=min(n, len(pool)))
    links = rng.sample(range(1, cfg.max_link + 1), k=len(names))
    products = [make_product(rng, nm, ln) for nm, ln in zip(names, sorted(links))]

    history = []
    for _ in range(rng.randint(0, cfg.max_history)):
        p = rng.choice(products)
        attr = rng.choice(sorted(p.attributes))
        history.append({"question": attribute_question(rng, p, attr), "response": fact(p, attr), "_fact": (p, attr)})

    kinds, weights = zip(*cfg.kind_weights.items())
    kind = rng.choices(kinds, weights)[0]
    if kind == "repeat" and not history:
        kind = "attribute"
    meta = {"kind": kind}
    if kind == "attribute":
        asked = {(q.link, a) for q, a in (h["_fact"] for h in history)}
        p, attr = rng.choice([(q, a) for q in products for a in sorted(q.attributes) if (q.link, a) not in asked])
        question = attribute_question(rng, p, attr)
        meta.update(link=p.link, attribute=attr, value=p.attributes[attr])
        extra = _supplement(p, attr)
        reference = fact(p, attr) + (f" {extra} is {p.attributes[extra]}." if extra else "")
    elif kind == "repeat":
        h = rng.choice(history)
        p, attr = h["_fact"]
        question = h["question"]
        meta.update(link=p.link, attribute=attr, value=p.attributes[attr])
        reference = "as said before, " + fact(p, attr)
    elif kind == "missing":
        absent = [nm for c in cats for nm in CATALOG[c]["names"] if nm not in names]
        if not absent:  # every product of these categories is listed: ask for one of another category
            absent = [nm for nm in PRODUCT_NAMES if nm not in names]
        asked = rng.choice(absent)
        question = rng.choice([f"do you have {asked}?", f"is there a {asked}?"])
        meta.update(name=asked, category=CATEGORY_OF[asked])
        alts = related(products, CATEGORY_OF[asked])[:2]
        reference = f"there is no {asked} in the list. " + " ".join(fact(a, "price") for a in alts)
    else:  # recommend
        cat = rng.choice(sorted({p.category for p in products}))
        key = CATALOG[cat]["key"]
        in_cat = [p for p in products if p.category == cat]
        if rng.random() < 0.5:
            value = rng.choice([p.attributes[key] for p in in_cat])
        else:
            value = rng.choice(CATALOG[cat]["attrs"][key])
        question = CATALOG[cat]["ask"].format(value=value)
        matches = [p.link for p in in_cat if p.attributes[key] == value]
        meta.update(category=cat, attribute=key, value=value, matches=matches)
        if matches:
            p = next(p for p in in_cat if p.link == matches[0])
            reference = fact(p, key) + " " + fact(p, "price")
        else:
            reference = f"there is no {value} {cat} in the list. " + " ".join(fact(p, key) for p in in_cat)
    for h in history:
        del h["_fact"]
    return {"id": room_id, "documents": [p.to_json() for p in products], "question": question,
            "history": history, "reference": reference, "meta": meta}


def _supplement(p: Product, attr: str):
    """The attribute a helpful answer adds (Appendix B: proactively offers supplementary information)."""
    others = [a for a in p.attributes if a != attr]
    return "price" if "price" in others else (others[0] if others else None)


def related(products: list, category: str) -> list:
    """Listed products worth offering instead, same category first (Appendix B rule 7)."""
    return sorted(products, key=lambda p: (p.category != category, p.link))


def products_of(room: dict) -> list:
    return [Product(d["link"], d["name"], d.get("category", CATEGORY_OF.get(d["name"], "")), dict(d["attributes"]))
            for d in room["documents"]]


def make_rooms(n: int, seed: int = 0, cfg: WorldConfig | None = None, prefix: str = "room") -> list:
    """n rooms, a pure function of (n, seed, cfg)."""
    rng = random.Random(seed)
    cfg = cfg or WorldConfig()
    return [make_room(rng, cfg, f"{prefix}-{seed}-{i}") for i in range(n)]
