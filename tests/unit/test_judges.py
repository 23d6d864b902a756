"""Judges on crafted cases: the seed's Table 1 examples re-expressed in the synthetic world, the Appendix B
rules one by one, EM/F1 on known pairs, the LLM judge's verdict parsing, dotted-path plugins."""
import json

import pytest

from livemoe.train.judges import (LLMJudge, SquadJudge, SyntheticJudge, Verdict, exact_match, f1_score, load_judge,
                          normalize_answer, parse_verdict, render_judge_prompt)


def product(link, name, category, **attrs):
    return {"link": link, "name": name, "category": category, "attributes": attrs}


# Table 1, top: several zongzi links; the gift box (link 8) is not the pork belly one (link 9)
ZONGZI = [product(5, "pork zongzi", "zongzi", filling="pork", weight="500 g", price="39 yuan"),
          product(8, "zongzi gift box", "zongzi", filling="mixed", weight="1 kg", price="129 yuan"),
          product(9, "pork belly zongzi", "zongzi", filling="pork belly", weight="500 g", price="49 yuan")]
# Table 1, bottom: screen protectors for other iphones and a phone case; none for the iphone 11
PROTECTORS = [product(1, "leather case", "phone case", fits="iphone 13", color="black", price="59 yuan"),
              product(12, "matte protector", "screen protector", fits="iphone 12", material="film", price="19 yuan"),
              product(13, "glass protector", "screen protector", fits="iphone 15", material="glass", price="29 yuan")]


def room(documents, question, meta, history=()):
    return {"id": "t", "documents": documents, "question": question, "history": list(history), "meta": meta}


J = SyntheticJudge()
FILLING_8 = room(ZONGZI, "what is the filling of the zongzi gift box?",
                 {"kind": "attribute", "link": 8, "attribute": "filling", "value": "mixed"})
PROTECTOR_11 = room(PROTECTORS, "recommend a screen protector for iphone 11.",
                    {"kind": "recommend", "category": "screen protector", "attribute": "fits",
                     "value": "iphone 11", "matches": []})


def judge(r, response, thought="checking the links."):
    return J(r, f"<think>{thought}</think>{response}")


def test_table1_incorrect_attribute_from_the_wrong_link():
    # the pork belly of link 9 attributed to the gift box of link 8
    v = judge(FILLING_8, "link 8 zongzi gift box: filling is pork belly. price is 129 yuan.")
    assert not v.correct and "filling 'pork belly'" in v.reason
    assert v.helpful  # helpfulness does not look at correctness (Appendix B table 7, rule 1)


def test_table1_incorrect_product_name_on_the_wrong_link():
    v = judge(FILLING_8, "link 8 pork belly zongzi: filling is mixed. price is 129 yuan.")
    assert not v.correct and "name 'pork belly zongzi'" in v.reason


def test_table1_correct_synthesis_over_several_links():
    v = judge(FILLING_8, "link 8 zongzi gift box: filling is mixed. link 9 pork belly zongzi: filling is pork belly. "
                         "link 5 pork zongzi: filling is pork.")
    assert v.correct and v.helpful, v.reason


def test_table1_unhelpful_bare_deflection_for_a_missing_product():
    v = judge(PROTECTOR_11, "there is no iphone 11 screen protector in the list. please ask customer service about it.")
    assert v.correct and not v.helpful, v.reason


def test_table1_helpful_alternatives_for_a_missing_product():
    v = judge(PROTECTOR_11, "there is no iphone 11 screen protector in the list. link 13 glass protector: fits is "
                            "iphone 15. link 12 matte protector: fits is iphone 12. please ask customer service too.")
    assert v.correct and v.helpful, v.reason


def test_false_negation_is_incorrect():
    r = room(PROTECTORS, "recommend a screen protector for iphone 12.",
             {"kind": "recommend", "category": "screen protector", "attribute": "fits", "value": "iphone 12",
              "matches": [12]})
    assert not judge(r, "there is no iphone 12 screen protector in the list. link 13 glass protector: fits is "
                        "iphone 15.").correct
    v = judge(r, "link 12 matte protector: fits is iphone 12. price is 19 yuan.")
    assert v.correct and v.helpful


def test_deflection_when_the_answer_is_listed_is_incorrect_and_unhelpful():
    v = judge(FILLING_8, "please ask customer service about it.")
    assert not v.correct and not v.helpful  # rules 3/5 and helpfulness rule 3


def test_bare_fact_is_correct_but_not_helpful():
    v = judge(FILLING_8, "link 8 zongzi gift box: filling is mixed.")
    assert v.correct and not v.helpful and "supplementary" in v.reason


def test_unknown_link_and_unverifiable_claims():
    assert not judge(FILLING_8, "link 8 zongzi gift box: filling is mixed. link 30 is cheap.").correct
    assert not judge(FILLING_8, "link 8 zongzi gift box: filling is mixed. color is red.").correct  # no such attribute
    assert not judge(FILLING_8, "price is 39 yuan. link 8 zongzi gift box: filling is mixed.").correct  # whose price?


def test_missing_product_rules():
    r = room(ZONGZI, "do you have red bean zongzi?", {"kind": "missing", "name": "red bean zongzi", "category": "zongzi"})
    good = judge(r, "there is no red bean zongzi in the list. link 5 pork zongzi: price is 39 yuan.")
    assert good.correct and good.helpful
    passed_off = judge(r, "link 5 red bean zongzi: price is 39 yuan.")  # a listed link passed off as the asked one
    assert not passed_off.correct
    silent = judge(r, "link 5 pork zongzi: price is 39 yuan.")  # never says it is not listed
    assert not silent.correct and silent.helpful


def test_repeated_question_rules_9_and_10():
    h = [{"question": "what is the filling of the zongzi gift box?", "response": "link 8 zongzi gift box: filling is mixed."}]
    r = room(ZONGZI, h[0]["question"], {"kind": "repeat", "link": 8, "attribute": "filling", "value": "mixed"}, h)
    ok = judge(r, "as said before, link 8 zongzi gift box: filling is mixed.")
    assert ok.correct and ok.helpful
    assert not judge(r, "link 8 zongzi gift box: filling is mixed. price is 129 yuan.").correct  # rule 9
    new = room(ZONGZI, "what is the weight of link 5?", {"kind": "attribute", "link": 5, "attribute": "weight",
                                                          "value": "500 g"}, h)
    assert not judge(new, "as said before, link 5 pork zongzi: weight is 500 g. price is 39 yuan.").correct  # rule 10


def test_unfinished_or_placeholder_reply_is_incorrect():
    assert not judge(FILLING_8, "link 8 zongzi gift box: filling is mixed. price is").correct
    assert not judge(FILLING_8, "").correct


def test_values_with_dots_and_the_thought_is_not_judged():
    ac = [product(7, "gree air conditioner", "air conditioner", type="cool only", power="1.5 hp", price="89 yuan")]
    r = room(ac, "what is the power of link 7?", {"kind": "attribute", "link": 7, "attribute": "power", "value": "1.5 hp"})
    v = judge(r, "link 7 gree air conditioner: power is 1.5 hp. price is 89 yuan.", thought="link 7 power is 2 hp.")
    assert v.correct and v.helpful, v.reason
    assert not judge(r, "link 7 gree air conditioner: power is 1 hp. price is 89 yuan.").correct


def test_synthetic_judge_refuses_other_data():
    with pytest.raises(ValueError, match="synthetic judge needs a room"):
        J({"id": "x", "documents": ["text"], "question": "q", "meta": {}}, "a")


# ---------------------------------------------------------------- EM / F1
@pytest.mark.parametrize("pred, truth, em, f1", [
    ("The Seine", "Seine", 1.0, 1.0),
    ("seine!", "the Seine.", 1.0, 1.0),
    ("river Seine", "Seine", 0.0, 2 / 3),
    ("Paris France", "the capital Paris", 0.0, 0.5),  # P = R = 1/2 once "the" is dropped
    ("London", "Seine", 0.0, 0.0),
    ("a an the", "the", 1.0, 0.0),  # both normalise to "", and F1 of no tokens is 0 (SQuAD's script)
])
def test_em_f1_known_pairs(pred, truth, em, f1):
    assert exact_match(pred, truth) == em
    assert f1_score(pred, truth) == pytest.approx(f1)


def test_normalize_answer():
    assert normalize_answer("  The  Big, red DOG. ") == "big red dog"


def test_squad_judge_takes_the_best_alias_and_ignores_the_thought():
    rec = {"id": "m", "documents": [], "question": "q", "reference": "Seine",
           "meta": {"kind": "musique", "answers": ["Seine", "River Seine"]}}
    v = SquadJudge()(rec, "<think>maybe the Thames</think>River Seine")
    assert v.correct and v.helpful and v.scores == {"em": 1.0, "f1": 1.0}
    v = SquadJudge()(rec, "the Thames")
    assert not v.correct and v.scores["f1"] == 0.0


# ---------------------------------------------------------------- LLM judge
@pytest.mark.parametrize("text, which, want", [
    ('{"Reason for Judgment": "fine", "Is the Response Correct": "yes"}', "correct", True),
    ('reasoning... {"判断原因": "不对", "回复是否正确": "否"}', "correct", False),
    ('{"判断原因": "有", "回复有无帮助": "是"}', "helpful", True),
    ('<think>{"Is the Response Helpful": "yes"}</think>{"Is the Response Helpful": "no"}', "helpful", False),
    ('{“Is the Response Correct”: “yes”}', "correct", True),  # curly quotes as in the seed's table
    ('{"Is the Response Correct": true}', "correct", True),
    ("I think it is correct.", "correct", None),
    ('{"Is the Response Correct": "maybe"}', "correct", None),
    ('{"Is the Response Helpful": "yes"}', "correct", None),  # the wrong key
])
def test_parse_verdict(text, which, want):
    assert parse_verdict(text, which) is want


def test_llm_judge_prompts_and_unparseable_counted():
    sent = []

    def complete(convs):
        sent.extend(convs)
        return ['{"Is the Response Correct": "yes"}', "garbage"] * (len(convs) // 2)

    j = LLMJudge(complete=complete)
    vs = j.judge_batch([FILLING_8, FILLING_8], ["<think>t</think>link 8 zongzi gift box: filling is mixed."] * 2)
    assert [(v.correct, v.helpful, v.unparseable) for v in vs] == [(True, False, True)] * 2
    assert j.unparseable == 2
    assert len(sent) == 4
    prompt = sent[0][0]["content"]
    assert "judge the correctness" in prompt and "zongzi gift box" in prompt and "filling is mixed" in prompt
    assert "<think>" not in prompt  # only the response is judged
    assert "whether the response was helpful" in sent[1][0]["content"]


def test_chinese_prompts():
    p = render_judge_prompt("correct", FILLING_8, "link 8 ...", "zh")
    assert p.startswith("## 指令") and "回复是否正确" in p and json.dumps(FILLING_8["question"]) in p
    assert "回复有无帮助" in render_judge_prompt("helpful", FILLING_8, "x", "zh")
    with pytest.raises(ValueError, match="language"):
        LLMJudge(complete=lambda c: c, language="fr")


def test_llm_judge_unreachable_endpoint_fails_fast_naming_the_url():
    from livemoe.train.endpoint import EndpointError

    with pytest.raises(EndpointError, match="127.0.0.1:9"):
        LLMJudge(url="http://127.0.0.1:9/v1", timeout_s=2.0)


# ---------------------------------------------------------------- registry
def always_yes(record, completion):
    return True, True


class Strict:
    def __call__(self, record, completion):
        return Verdict(False, False, "strict")


def test_load_judge_builtin_and_dotted_paths():
    assert isinstance(load_judge("synthetic"), SyntheticJudge)
    assert load_judge("auto")(FILLING_8, "link 8 zongzi gift box: filling is mixed.").correct
    assert load_judge("test_judges:always_yes")(FILLING_8, "x") == Verdict(True, True)
    assert load_judge("test_judges.Strict")(FILLING_8, "x").reason == "strict"
    with pytest.raises(ValueError, match="cannot be imported"):
        load_judge("no_such_module:judge")
    with pytest.raises(ValueError, match="'nonsense': expected a dotted path 'module:attr' .the built-in judges: auto,"):
        load_judge("nonsense")


def test_llm_judge_with_a_local_engine_model(tmp_path):
    """The Appendix B prompts through the engine decoder on a local checkpoint: a random tiny model
    answers gibberish, which must count as unparseable fails, not stop the run."""
    from tiny_models import make_checkpoint

    from livemoe.train.synthetic.tokenizer import train_tokenizer

    prompts = [render_judge_prompt(w, FILLING_8, "x", lang) for w in ("correct", "helpful") for lang in ("en", "zh")]
    tok = train_tokenizer(prompts * 5, vocab_size=1500)
    path, _ = make_checkpoint(tmp_path / "judge", moe=False, vocab_size=len(tok), max_position_embeddings=4096)
    tok.save_pretrained(path)
    j = load_judge("llm", model=path, max_tokens=4)
    vs = j.judge_batch([FILLING_8], ["<think>t</think>link 8 zongzi gift box: filling is mixed."])
    assert len(vs) == 1 and not vs[0].correct and vs[0].unparseable and j.unparseable == 2
