"""Judges: correctness C and helpfulness H of a completion (`<think>T</think>R`; only R is judged).

  synthetic  rule-based, for the synthetic world: every link / name / attribute claim of R is checked
             against the documents; C and H follow the seed's Appendix B rules (cited inline)
  squad      exact match and F1 with SQuAD normalisation, for MuSiQue (C = EM; H not used: always 1)
  llm        the seed's Appendix B prompts (English or the Chinese original) sent to an OpenAI-compatible
             endpoint or any `complete(list_of_messages) -> list[str]` backend; a verdict that does not
             parse counts as a fail and is counted (`unparseable`), never stopping the run
  auto       synthetic for the world's rooms, squad for MuSiQue records
  a.b.c:obj  any callable or class by dotted import path: fn(record, completion) -> Verdict | dict | (C, H)
"""
import json
import os
import re
import string
from collections import Counter
from dataclasses import dataclass, field

from livemoe.train.data import split_thought
from livemoe.train.imports import import_object
from livemoe.train.synthetic.world import CATALOG, KINDS, PRODUCT_NAMES, products_of


@dataclass(slots=True)
class Verdict:
    correct: bool
    helpful: bool
    reason: str = ""
    scores: dict = field(default_factory=dict)
    unparseable: bool = False


class Judge:
    name = "judge"

    def __call__(self, record: dict, completion: str) -> Verdict:
        raise NotImplementedError

    def judge_batch(self, records: list, completions: list) -> list:
        return [self(r, c) for r, c in zip(records, completions, strict=True)]


# ---------------------------------------------------------------- rule-based judge, synthetic world
_ATTR = "|".join(sorted({a for c in CATALOG.values() for a in c["attrs"]} | {"price"}, key=len, reverse=True))
# a value runs to the end of its sentence: a "." then a space or the end ("1.5 hp." is one value)
_ATTR_CLAIM = re.compile(rf"\b({_ATTR}) is ([^,;!?]+?)(?=\.\s|\.$|[,;!?]|$)")
_LINK = re.compile(r"\blink (\d+)\b")
_NEGATION = re.compile(r"\bno ([a-z0-9. ]+?) in the list")
_BEFORE = re.compile(r"\b(said before|answered before|already answered|asked before)\b")
_NAMES = sorted(PRODUCT_NAMES, key=len, reverse=True)


def _leading_name(text: str):
    text = text.lstrip(" :").removeprefix("is ").removeprefix("the ")
    return next((n for n in _NAMES if text.startswith(n) and not text[len(n):len(n) + 1].isalnum()), None)


@dataclass
class Claims:
    links: dict = field(default_factory=dict)      # link -> list of (kind, key, value, ok)
    unlinked: list = field(default_factory=list)   # attribute claims with no link to check against
    negations: list = field(default_factory=list)  # (phrase, ok)

    @property
    def false(self) -> list:
        bad = [f"link {k}: {c[0]} {c[1]} {c[2]!r}" for k, cs in self.links.items() for c in cs if not c[3]]
        bad += [f"unverifiable claim {a} is {v!r}" for a, v in self.unlinked]
        return bad + [f"wrong 'no {p} in the list'" for p, ok in self.negations if not ok]


def extract_claims(response: str, products: list) -> Claims:
    """Every checkable claim of a response in the world's language, each marked true or false."""
    text = response.lower()
    by_link = {p.link: p for p in products}
    out = Claims()
    for phrase in _NEGATION.findall(text):
        out.negations.append((phrase, _negation_holds(phrase.strip(), products)))
    marks = list(_LINK.finditer(text))
    head = text[: marks[0].start()] if marks else text
    out.unlinked = [(a, v.strip()) for a, v in _ATTR_CLAIM.findall(_NEGATION.sub("", head))]
    for i, m in enumerate(marks):
        link = int(m.group(1))
        seg = text[m.end(): marks[i + 1].start() if i + 1 < len(marks) else len(text)]
        claims = out.links.setdefault(link, [])
        p = by_link.get(link)
        if p is None:
            claims.append(("exists", "link", link, False))
            continue
        name = _leading_name(seg)
        if name is not None:
            claims.append(("name", "name", name, name == p.name))
        for attr, value in _ATTR_CLAIM.findall(seg):
            value = value.strip()
            claims.append(("attr", attr, value, p.attributes.get(attr) == value))
    return out


def _negation_holds(phrase: str, products: list) -> bool:
    """'no X in the list' is true when no listed product is X (a name, or '<value> <category>')."""
    if phrase in PRODUCT_NAMES:
        return all(p.name != phrase for p in products)
    for cat in sorted(CATALOG, key=len, reverse=True):
        if phrase.endswith(cat):
            value = phrase[: -len(cat)].strip()
            return not any(p.category == cat and value in p.attributes.values() for p in products)
    return False  # a phrase the documents cannot settle is not verifiable


class SyntheticJudge(Judge):
    name = "synthetic"

    def __call__(self, record: dict, completion: str) -> Verdict:
        meta = record.get("meta", {})
        if meta.get("kind") not in KINDS or not all(isinstance(d, dict) and "link" in d for d in record["documents"]):
            raise ValueError(f"record {record.get('id')!r}: the synthetic judge needs a room of the synthetic "
                             "world (structured product documents and meta.kind); use --judge llm or squad")
        _, response = split_thought(completion)
        products = products_of(record)
        by_link = {p.link: p for p in products}
        claims = extract_claims(response, products)
        text = response.lower()
        kind = meta["kind"]
        asked = {(link, c[1]) for link, cs in claims.links.items() for c in cs if c[0] == "attr"}
        named = {link for link, cs in claims.links.items() if cs}

        # correctness (Appendix B, table 6)
        why = list(claims.false)  # rules 3 and 8: nothing beyond or against the product information
        if not response or response[-1] not in ".!?" or "xx" in text.split():
            why.append("empty, unfinished or placeholder reply (rule 12)")
        said_before = bool(_BEFORE.search(text))
        if kind == "repeat" and not said_before:
            why.append("repeated question not pointed out (rule 9)")
        if kind != "repeat" and said_before:
            why.append("claims the question was answered before (rule 10)")
        if kind == "attribute" and (meta["link"], meta["attribute"]) not in asked:
            why.append("the asked attribute is in the documents but not answered (rules 1, 3, 5)")
        if kind == "missing" and not any(p == meta["name"] and ok for p, ok in claims.negations):
            why.append(f"does not say {meta['name']} is not listed (rule 3)")
        if kind == "recommend":
            if meta["matches"] and not set(meta["matches"]) & named:
                why.append("a listed product fits but none is recommended (rule 3)")
            if not meta["matches"] and not any(ok for _, ok in claims.negations):
                why.append("does not say that no listed product fits (rule 3)")
        why = list(dict.fromkeys(why))[:8]  # a looping reply repeats the same false claim: say it once
        correct = not why

        # helpfulness (Appendix B, table 7): concrete, relevant information; correctness not considered
        if not named:
            hwhy = "no product information given (rules 3, 6)"
        elif kind == "attribute" and (meta["link"], meta["attribute"]) not in asked:
            hwhy = "does not address the asked attribute (rule 4)"
        elif kind == "attribute" and len(asked) < 2:
            hwhy = "no supplementary information beyond the bare fact (rule 6)"
        elif kind == "repeat" and (meta["link"], meta["attribute"]) not in asked:
            hwhy = "does not restate the answer the viewer asks for again (rule 2)"
        elif kind == "recommend" and not any(by_link[k].category == meta["category"] for k in named if k in by_link):
            hwhy = f"no {meta['category']} offered (rule 5)"
        else:
            hwhy = ""
        helpful = not hwhy
        return Verdict(correct, helpful, "; ".join(why + ([hwhy] if hwhy else [])))


# ---------------------------------------------------------------- EM / F1, SQuAD normalisation
def normalize_answer(s: str) -> str:
    """SQuAD v1.1: lower case, drop punctuation and articles, squeeze whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def exact_match(prediction: str, truth: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(truth))


def f1_score(prediction: str, truth: str) -> float:
    p, t = normalize_answer(prediction).split(), normalize_answer(truth).split()
    common = Counter(p) & Counter(t)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(p), same / len(t)
    return 2 * precision * recall / (precision + recall)


class SquadJudge(Judge):
    name = "squad"

    def __call__(self, record: dict, completion: str) -> Verdict:
        answers = record.get("meta", {}).get("answers") or ([record["reference"]] if record.get("reference") else None)
        if not answers:
            raise ValueError(f"record {record.get('id')!r}: the EM/F1 judge needs an answer (MuSiQue 'answer' "
                             "or a 'reference')")
        _, response = split_thought(completion)
        em = max(exact_match(response, a) for a in answers)
        f1 = max(f1_score(response, a) for a in answers)
        return Verdict(bool(em), True, f"EM {em:.0f} F1 {f1:.2f}", {"em": em, "f1": f1})


# ---------------------------------------------------------------- LLM judge, the seed's Appendix B
PROMPTS = {
    "en": {
        "correct": (
            "## Instruction\nThe AI streamer will respond based on historical dialogue, product information, and "
            "the question. You need to judge the correctness of the AI streamer's response to the audience.\n"
            "## Requirements\n"
            "1. Judge whether the audience's intent was correctly understood with a direct answer provided. If the "
            "response is irrelevant, it should be judged as incorrect. The AI's paraphrasing of the question being "
            "irrelevant also counts as incorrect. However, if the response is helpful, it should not be considered "
            "irrelevant even if not a direct answer.\n"
            "2. If dialogue history is not empty, consider the true intent of the question within the context. If "
            "the AI's response misinterprets the multi-turn context, it should be judged as incorrect.\n"
            "3. The response must not exceed the provided product information, nor should it fail to answer a "
            "question when the information is available. If information is insufficient or the product is not "
            "listed, guiding the user to customer service is correct.\n"
            "4. The response must not contain logical contradictions.\n"
            "5. If the information can partially answer the question, the AI should not be judged as incorrect if "
            "it offers this partial help. This does not apply if the audience repeatedly asks the same question.\n"
            "6. If the audience asks about attributes/price for an unavailable product, it is incorrect for the AI "
            "to recommend other products.\n"
            "7. If the audience asks for a recommendation or searches for an unavailable product, it is correct for "
            "the AI to recommend other, somewhat related products.\n"
            "8. The attributes and prices in the response must not contradict the product information. Product "
            "information is the authoritative source in case of conflicts.\n"
            "9. If asked the same question again, the AI is incorrect if it doesn't mention that the question has "
            "already been answered.\n"
            "10. If asked a new question, the AI is incorrect if it claims the question was already answered "
            "without addressing the new question.\n"
            "11. Questions about claiming national subsidies are correct by default. However, a product's subsidy "
            "eligibility must be based on product information. This rule generally applies to electronics.\n"
            "12. Responses with placeholders like \"xx\" or ending abruptly are incorrect.\n"
            "## Additional Clarifications for Rules 6 and 7\n"
            "{\"Product Attribute/Price Inquiry\": [\"what is the price of link 3?\", \"does the wool scarf come "
            "in red?\"], \"Product Search/Recommendation\": [\"do you have a silk scarf?\", \"recommend a cool only "
            "air conditioner.\"]}\n"
            "## Output Example\n{\"Reason for Judgment\": \"xxx\", \"Is the Response Correct\": \"yes or no\"}\n"
            "--Real Data--\n{\"Product Information\": {item_info}, \"Dialogue History\": {history}, "
            "\"Audience Question\": {query}, \"AI Response\": {response}}"),
        "helpful": (
            "## Instruction\nThe AI streamer will respond to the audience's comments. You will be given the AI's "
            "response, the audience's comment, and the dialogue history. You need to judge whether the response "
            "was helpful to the audience.\n"
            "## Requirements\n"
            "1. The main consideration is whether the AI streamer's response was helpful to the audience. "
            "Helpfulness evaluation should not consider the correctness of the information.\n"
            "2. When assessing helpfulness, you must consider the dialogue history to determine if the response "
            "addressed the audience's true intent.\n"
            "3. Directly referring the audience to customer service without providing any information is "
            "considered not helpful. Offering partial information and then suggesting customer service is "
            "considered helpful.\n"
            "4. An irrelevant response is considered not helpful.\n"
            "5. If the AI cannot find the exact product the audience wants but recommends a similar one, it is "
            "considered helpful. If it fails to find the product and simply refers to customer service, it is not "
            "helpful.\n"
            "6. The key criterion for helpfulness is whether the AI provided information that the audience would "
            "not have known otherwise. Stating that a product could not be found or that certain information is "
            "unknown is not considered helpful.\n"
            "## Output Example\n{\"Reason for Judgment\": \"xxx\", \"Is the Response Helpful\": \"yes or no\"}\n"
            "--Real Data--\n{\"Dialogue History\": {history}, \"Audience Question\": {query}, "
            "\"AI Response\": {response}}"),
    },
    "zh": {
        "correct": (
            "## 指令\nAI主播会基于历史对话、商品信息和观众的当前问题进行回复，你需要对AI主播对观众的回复正确性进行判断。\n"
            "## 要求\n"
            "1. 判断是否正确理解观众意图，针对观众问题直接给出了回复，若答非所问应判为不正确。AI主播的复述观众部分答非所问的话也应判为不正确。"
            "回复内容能给到观众帮助的情况下，即使没有直接回复也不应算作答非所问。\n"
            "2. 如果有对话历史，需要考虑在对话历史下当前问题的真实意图。不能在多轮对话中答非所问，如果AI主播回复错误理解了多轮对话，那么应判为不正确。\n"
            "3. 回复内容既不能超出给出的商品信息，也不能出现商品信息能够回答观众问题但是AI主播不回答的情况。如果商品信息不足以回答观众问题"
            "或者观众不是问的商品信息给出的商品，那么AI主播引导观众咨询客服是正确的。\n"
            "4. 回复内容本身不能有逻辑矛盾的情况。\n"
            "5. 如果给出的信息能回答观众的部分问题，即使不能全部解决问题，如果AI主播不给出任何帮助直接引导客服，那么应该判为不正确。"
            "本条在观众重复问相同问题时不适用。\n"
            "6. 如果观众是在咨询关于商品属性、价格相关问题，但没有这个商品，AI主播推荐其他商品给观众是不正确的。\n"
            "7. 如果观众是要求主播推荐商品或者在查询商品，但是没有这个商品的这种情况下，AI主播给观众推荐其他的商品是正确的，"
            "这里的其他商品只要稍微相关就行，不需要完全符合观众要求。\n"
            "8. AI回复中商品属性和商品价格不能违背商品信息的属性和价格，如果与历史对话有冲突以商品信息为准。\n"
            "9. 问到与之前相同的问题，但是AI主播却没有提醒观众已经说过了应算作不正确，提醒观众之前已经回答过了算作正确。\n"
            "10. 如果观众问题和之前问题不同却提醒观众之前已经回答过了但并未针对新问题进行回复应判为不正确。\n"
            "11. 国补去哪领、怎么领这种问题不需要按照商品信息回答默认判为正确，但是商品本身是否有补贴需要按照商品信息进行回答。"
            "一般政府补贴是电子产品，其他产品不适用本条。\n"
            "12. 回复中出现“xx”这种省略词的或者最后出现话没说完的情况这种明显不通顺的都是不正确的。\n"
            "## 针对6、7两条的额外说明\n"
            "{\"商品属性、价格咨询\": [\"3号链接多少钱？\", \"羊毛围巾有红色的吗？\"], \"商品查询、推荐\": [\"有丝巾吗？\", \"推荐一款单冷的空调。\"]}\n"
            "## 输出示例\n{\"判断原因\": \"xxx\", \"回复是否正确\": \"是或否\"}\n"
            "--真实数据--\n{\"商品信息\": {item_info}, \"对话历史\": {history}, \"观众问题\": {query}, \"AI主播回复\": {response}}"),
        "helpful": (
            "## 指令\nAI主播会对观众的弹幕进行回复，会给你AI主播的回复，还会给你观众的弹幕以及对话历史，你需要判断回复是否给观众带来了帮助。\n"
            "## 要求\n"
            "1. 要考量的是数字人主播的回复是否给观众带来的帮助，帮助性不需要考虑回复的信息是否正确。\n"
            "2. 在比较帮助性时需要考虑历史对话，即回复是否对观众在历史对话中的真实意图给出了帮助性。\n"
            "3. 没有给出任何帮助直接让观众找客服属于没有帮助的范畴。给到观众部分帮助并让观众去找客服属于有帮助。\n"
            "4. 答非所问也属于没有帮助。\n"
            "5. AI主播没有找到观众想要的商品给观众推荐了类似的商品属于有帮助，如果没找到并直接引导观众去找客服属于没有给出任何帮助。\n"
            "6. 是否给出帮助的关键判断依据是AI是否给到了观众不来问就不知道的信息。没找到商品、不知道xx信息属于是没有帮助的信息。\n"
            "## 输出示例\n{\"判断原因\": \"xxx\", \"回复有无帮助\": \"是或否\"}\n"
            "--真实数据--\n{\"对话历史\": {history}, \"观众问题\": {query}, \"AI主播回复\": {response}}"),
    },
}
VERDICT_KEYS = {"correct": ("Is the Response Correct", "回复是否正确"), "helpful": ("Is the Response Helpful", "回复有无帮助")}
YES = {"yes", "true", "correct", "helpful", "1", "是", "正确", "有帮助", "有", "对"}
NO = {"no", "false", "incorrect", "unhelpful", "not helpful", "0", "否", "不正确", "错误", "没有帮助", "无帮助", "无", "不对"}


def render_judge_prompt(which: str, record: dict, completion: str, language: str = "en") -> str:
    from livemoe.train.data import render_document

    _, response = split_thought(completion)
    values = {"item_info": [render_document(d) for d in record["documents"]],
              "history": [{"question": h["question"], "response": h["response"]} for h in record.get("history", [])],
              "query": record["question"], "response": response}
    text = PROMPTS[language][which]
    for k, v in values.items():  # str.replace: the templates hold literal JSON braces
        text = text.replace("{" + k + "}", json.dumps(v, ensure_ascii=False))
    return text


def parse_verdict(text: str, which: str):
    """True / False from a judge's JSON answer, or None when it cannot be read."""
    text = re.sub(r"<think>.*?</think>", "", text or "", flags=re.S)
    for m in reversed(list(re.finditer(r"\{[^{}]*\}", text, flags=re.S))):
        try:
            obj = json.loads(m.group(0).replace("“", '"').replace("”", '"'))
        except json.JSONDecodeError:
            continue
        for key in VERDICT_KEYS[which]:
            if key in obj:
                value = obj[key]
                if isinstance(value, bool):
                    return value
                v = str(value).strip().strip("。.").lower()
                if v in YES:
                    return True
                if v in NO:
                    return False
                return None
    return None


def engine_complete(path: str, max_tokens: int = 512):
    """`complete` over a local checkpoint with the engine decoder (greedy, the checkpoint's chat template)."""
    from livemoe.engine.llm import LLM
    from livemoe.engine.sampling.params import SamplingParams

    llm = LLM(path)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return lambda convs: [o.text for o in llm.chat(convs, params)]


class LLMJudge(Judge):
    """Appendix B judge over `complete(list of chat message lists) -> list of texts`."""

    name = "llm"

    def __init__(self, complete=None, url: str | None = None, model: str = "default", language: str = "en",
                 max_tokens: int = 512, **endpoint_kw):
        if language not in PROMPTS:
            raise ValueError(f"judge language must be one of {sorted(PROMPTS)}, got {language!r}")
        if complete is None and not url and model and os.path.isdir(model):
            complete = engine_complete(model, max_tokens)
        if complete is None:
            if not url:
                raise ValueError("the LLM judge needs --judge_url (an OpenAI-compatible endpoint) or --judge_model "
                                 "naming a local checkpoint directory")
            from livemoe.train.endpoint import ChatEndpoint

            endpoint = ChatEndpoint(url, model=model, max_tokens=max_tokens, **endpoint_kw)
            endpoint.check()
            complete = lambda convs: [t[0] for t in endpoint.chat_many(convs, temperature=0.0)]  # noqa: E731
        self.complete, self.language = complete, language
        self.unparseable = 0

    def judge_batch(self, records: list, completions: list) -> list:
        convs = [[{"role": "user", "content": render_judge_prompt(w, r, c, self.language)}]
                 for r, c in zip(records, completions, strict=True) for w in ("correct", "helpful")]
        texts = self.complete(convs)
        out = []
        for i in range(len(records)):
            c, h = parse_verdict(texts[2 * i], "correct"), parse_verdict(texts[2 * i + 1], "helpful")
            bad = (c is None) + (h is None)
            self.unparseable += bad
            out.append(Verdict(bool(c), bool(h), texts[2 * i][-200:], unparseable=bad > 0))
        return out

    def __call__(self, record: dict, completion: str) -> Verdict:
        return self.judge_batch([record], [completion])[0]


# ---------------------------------------------------------------- registry
class AutoJudge(Judge):
    name = "auto"

    def __init__(self):
        self.synthetic, self.squad = SyntheticJudge(), SquadJudge()

    def __call__(self, record: dict, completion: str) -> Verdict:
        kind = record.get("meta", {}).get("kind")
        return (self.squad if kind == "musique" else self.synthetic)(record, completion)


class _FunctionJudge(Judge):
    def __init__(self, fn, name: str):
        self.fn, self.name = fn, name

    def __call__(self, record: dict, completion: str) -> Verdict:
        v = self.fn(record, completion)
        if isinstance(v, Verdict):
            return v
        if isinstance(v, dict):
            return Verdict(bool(v["correct"]), bool(v.get("helpful", True)), str(v.get("reason", "")))
        c, h = v
        return Verdict(bool(c), bool(h))


def load_judge(spec: str, **kwargs) -> Judge:
    """'auto' | 'synthetic' | 'squad' | 'llm' | 'package.module:attr' (or 'package.module.attr')."""
    builtin = {"auto": AutoJudge, "synthetic": SyntheticJudge, "squad": SquadJudge, "llm": LLMJudge}
    if spec in builtin:
        return builtin[spec](**kwargs) if spec == "llm" else builtin[spec]()
    try:
        obj = import_object(spec)
    except ValueError as e:
        raise ValueError(f"judge {spec!r}: {e} (the built-in judges: {', '.join(sorted(builtin))})") from None
    if isinstance(obj, type):
        obj = obj(**kwargs)
    return obj if isinstance(obj, Judge) else _FunctionJudge(obj, spec)


def make_judge(cfg) -> Judge:
    """The judge of a run config (livemoe.train.config.RunConfig): --judge, and for `llm` an endpoint (--judge_url) or a
    local checkpoint (--judge_model) judged with the engine's decoder."""
    if cfg.judge == "llm":
        kw = dict(api_key=os.environ.get(cfg.judge_api_key_env), concurrency=cfg.judge_concurrency) if cfg.judge_url else {}
        return load_judge("llm", url=cfg.judge_url, model=cfg.judge_model, language=cfg.judge_language, **kw)
    return load_judge(cfg.judge)
