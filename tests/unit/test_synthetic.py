"""The synthetic world and its scripted teacher: deterministic, every kind present, failure rates honoured."""
from collections import Counter

import pytest

from livemoe.train.data import split_thought
from livemoe.train.judges import SyntheticJudge
from livemoe.train.synthetic import ScriptedTeacher, TeacherRates, WorldConfig, make_rooms
from livemoe.train.synthetic.world import KINDS, products_of


def test_rooms_are_deterministic_and_distinct():
    a, b, c = make_rooms(20, seed=1), make_rooms(20, seed=1), make_rooms(20, seed=2)
    assert a == b
    assert a != c
    assert len({r["id"] for r in a}) == 20


def test_rooms_cover_every_kind_and_are_consistent():
    rooms = make_rooms(300, seed=0)
    kinds = Counter(r["meta"]["kind"] for r in rooms)
    assert set(kinds) == set(KINDS), kinds
    for r in rooms:
        products = products_of(r)
        links = [p.link for p in products]
        assert len(set(links)) == len(links) and len({p.name for p in products}) == len(products)
        meta = r["meta"]
        if meta["kind"] in ("attribute", "repeat"):
            p = next(p for p in products if p.link == meta["link"])
            assert p.attributes[meta["attribute"]] == meta["value"]
        if meta["kind"] == "repeat":
            assert r["question"] in [h["question"] for h in r["history"]]
        if meta["kind"] == "attribute":  # a new question is never one already answered
            assert r["question"] not in [h["question"] for h in r["history"]]
        if meta["kind"] == "missing":
            assert meta["name"] not in {p.name for p in products}
        if meta["kind"] == "recommend":
            assert meta["matches"] == [p.link for p in products if p.category == meta["category"]
                                       and p.attributes[meta["attribute"]] == meta["value"]]


def test_world_config_changes_room_size():
    rooms = make_rooms(30, seed=0, cfg=WorldConfig(num_products=(3, 3)))
    assert all(len(r["documents"]) == 3 for r in rooms)


def test_teacher_is_deterministic_and_shaped():
    rooms = make_rooms(10, seed=4)
    t = ScriptedTeacher(seed=7)
    a, b = t.sample(rooms, k=4), t.sample(rooms, k=4)
    assert a == b and len(a) == 10 and all(len(c) == 4 for c in a)
    for cands in a:
        for c in cands:
            assert c.startswith("<think>") and "</think>" in c
            thought, response = split_thought(c)
            assert thought and response
    assert ScriptedTeacher(seed=8).sample(rooms, k=4) != a


def test_teacher_failure_rates_show_up_in_the_judge():
    """wrong_link -> incorrect, deflect -> unhelpful, at about the configured rates (400 draws)."""
    rooms = make_rooms(100, seed=5)
    judge = SyntheticJudge()
    for rates, want_bad in ((TeacherRates(0, 0, 0), 0.0), (TeacherRates(0.5, 0.3, 0), 0.8)):
        cands = ScriptedTeacher(rates, seed=1).sample(rooms, k=4)
        verdicts = [judge(r, c) for r, cs in zip(rooms, cands) for c in cs]
        bad = sum(not (v.correct and v.helpful) for v in verdicts) / len(verdicts)
        # tolerance: binomial std at n=400, p=0.8 is 0.02; missing-kind deflections stay correct but unhelpful
        assert bad == pytest.approx(want_bad, abs=0.08), (rates, bad)


def test_verbose_thoughts_are_longer_but_judged_the_same():
    rooms = make_rooms(50, seed=6)
    t, judge = ScriptedTeacher(seed=0), SyntheticJudge()
    for r in rooms:
        short, long = t.answer(r, 0, "good", False), t.answer(r, 0, "good", True)
        assert len(long) > len(short) + 100
        assert split_thought(short)[1] == split_thought(long)[1]
        v = judge(r, long)
        assert v.correct and v.helpful, v.reason


def test_bad_rates_are_rejected():
    with pytest.raises(ValueError, match="wrong_link"):
        TeacherRates(wrong_link=1.5)


def test_scripted_teacher_refuses_other_data():
    with pytest.raises(ValueError, match="not a room of the synthetic world"):
        ScriptedTeacher().sample([{"id": "m", "documents": ["p"], "question": "q", "meta": {"kind": "musique"}}])


def test_teacher_supplements_with_a_listed_attribute_before_the_price():
    """A good attribute answer states the asked fact and one more: the product's first attribute besides
    the asked one and the price (the student reads a price worst, issue 19); missing-product and
    recommendation answers name products without prices."""
    from livemoe.train.judges import extract_claims
    from livemoe.train.synthetic.teacher import supplement
    from livemoe.train.synthetic.world import products_of

    rooms = make_rooms(200, seed=11)
    t = ScriptedTeacher(seed=0)
    seen = {"attribute": 0, "missing": 0, "recommend": 0}
    for r in rooms:
        kind = r["meta"]["kind"]
        if kind not in seen:
            continue
        seen[kind] += 1
        products = products_of(r)
        claims = extract_claims(split_thought(t.answer(r, 0, "good", False))[1], products)
        attrs = [(link, c[1]) for link, cs in claims.links.items() for c in cs if c[0] == "attr"]
        assert not claims.false
        if kind == "attribute":
            p = next(q for q in products if q.link == r["meta"]["link"])
            extra = supplement(p, r["meta"]["attribute"])
            assert extra != "price" and attrs == [(p.link, r["meta"]["attribute"]), (p.link, extra)]
        else:
            assert all(a != "price" for _, a in attrs)
    assert all(n >= 20 for n in seen.values()), seen
    p = products_of(rooms[0])[0]
    only_price = type(p)(p.link, p.name, p.category, {"color": "red", "price": "19 yuan"})
    assert supplement(only_price, "color") == "price" and supplement(only_price, "price") == "color"
    assert supplement(type(p)(1, "x", "y", {"price": "19 yuan"}), "price") is None


def test_missing_product_answer_offers_the_alternative_in_the_list_walks_words():
    """The alternative's sentence is one the thought's list walk already wrote (the answer copies it instead
    of pairing a link with a name again, issue 19), and the judge reads it as a true, named product."""
    from livemoe.train.judges import SyntheticJudge, extract_claims
    from livemoe.train.synthetic.world import products_of, related

    rooms = [r for r in make_rooms(300, seed=12) if r["meta"]["kind"] == "missing"]
    assert len(rooms) >= 30
    t, judge = ScriptedTeacher(seed=0), SyntheticJudge()
    for r in rooms:
        completion = t.answer(r, 0, "good", False)
        thought, response = split_thought(completion)
        alt = related(products_of(r), r["meta"]["category"])[0]
        offer = f"link {alt.link} is {alt.name}."
        walk = thought[thought.index(f"looks for {r['meta']['name']}."):thought.index(" none is ")]
        assert response == f"there is no {r['meta']['name']} in the list. {offer}" and offer in walk
        assert extract_claims(response, products_of(r)).links == {alt.link: [("name", "name", alt.name, True)]}
        v = judge(r, completion)
        assert v.correct and v.helpful, v.reason
