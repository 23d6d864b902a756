"""Text of the synthetic world: what the student's tokenizer is trained on and pre-trained with.

Pre-training conversations are the base skill a real student brings: in-context lookup, in the chat
layout, answered with the bare fact (correct but not yet helpful, no thought, no handling of missing
products or repeated questions). RFT has to teach the rest.
"""
import random

from livemoe.train.data import build_messages
from livemoe.train.synthetic.teacher import ScriptedTeacher
from livemoe.train.synthetic.world import WorldConfig, attribute_question, fact, make_rooms, products_of

# products per recall list: from 2 (a match among few is found sooner) up to the world's most
RECALL_PRODUCTS = (2, WorldConfig().num_products[1])
QUESTIONS_PER_CONVERSATION = 8  # the committed student's pre-training conversations (and RFT's --rehearsal)


def lookup_conversation(room: dict, rng: random.Random, turns: int) -> list:
    """The room's product list, then `turns` attribute questions answered with the bare fact."""
    products = products_of(room)
    msgs = build_messages({**room, "history": [], "question": "?"})[:1]
    for _ in range(turns):
        p = rng.choice(products)
        attr = rng.choice(sorted(p.attributes))
        msgs += [{"role": "user", "content": attribute_question(rng, p, attr)},
                 {"role": "assistant", "content": fact(p, attr)}]
    return msgs


def recall_sequence(room: dict, rng: random.Random, queries: int) -> list:
    """A dense associative-recall drill in the world's own format: the room's product list with ONE
    attribute per product (a compact list, so most tokens are questions and answers), then `queries`
    questions about those facts, asked by name or by link as attribute_question draws, each answered
    with the bare fact. Asked by name, the answer's link is the product list's number before that name:
    the hop the student misses most (issue 19)."""
    products = products_of(room)
    kept = []
    for p in products:
        attr = rng.choice(sorted(p.attributes))
        kept.append((p, attr))
    docs = [{**d, "attributes": {attr: d["attributes"][attr]}} for d, (_, attr) in zip(room["documents"], kept)]
    msgs = build_messages({**room, "documents": docs, "history": [], "question": "?"})[:1]
    for _ in range(queries):
        # drawn independently: a fixed order (each fact once before any twice) taught the student a shortcut,
        # "not the link just answered", that fell below chance on a single question
        p, attr = rng.choice(kept)
        msgs += [{"role": "user", "content": attribute_question(rng, p, attr)},
                 {"role": "assistant", "content": fact(p, attr)}]
    return msgs


def tokenizer_corpus(n_rooms: int = 2000, seed: int = 1234):
    """Texts covering every word the world, its prompts and its teacher use."""
    rooms = make_rooms(n_rooms, seed=seed, cfg=WorldConfig(), prefix="corpus")
    teacher = ScriptedTeacher(seed=seed)
    for room in rooms:
        for m in build_messages(room):
            yield f"{m['role']}\n{m['content']}"
        yield room["reference"]
        yield from teacher.sample([room], k=2)[0]


def encode_conversation(msgs, tok) -> tuple:
    """input_ids and a 0/1 mask that is 1 on assistant answer tokens (and their <|im_end|>): how the student is
    pre-trained on these conversations (scripts/pretrain_student.py) and how RFT rehearses them (--rehearsal)."""
    ids, mask = [], []
    for m in msgs:
        text = tok.apply_chat_template([m], tokenize=False)
        piece = tok(text, add_special_tokens=False)["input_ids"]
        if m["role"] == "assistant":
            head = len(tok("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"])
            mask += [0] * head + [1] * (len(piece) - head - 1) + [0]  # answer + <|im_end|>, not the "\n"
        else:
            mask += [0] * len(piece)
        ids += piece
    return ids, mask
