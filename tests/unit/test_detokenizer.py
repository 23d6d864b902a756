"""IncrementalDetokenizer: deltas joined equal the one-shot decode; a character split over tokens is
held back whole (no U+FFFD is ever sent for it); invalid bytes still flush past the cap; stop strings
being completed are held back."""
import random

import pytest

from livemoe.engine.text.detokenizer import IncrementalDetokenizer
from tiny_tokenizer import byte_token_ids, train_tokenizer

TEXTS = ["你好，世界！今天的天气很好。", "Emoji 🙂🚀🎉 and café, naïve 😀👍", "ライブ配信のアシスタントです。",
         "mixed 直播 🙂 text é ü ß 界"]


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


class ByteTokenizer:
    """One token per byte (ids 0-255) plus id 256, a special token that decodes to nothing."""

    def decode(self, ids, skip_special_tokens=True):
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def stream_text(detok, ids, chunk=1, final_text=None):
    parts = [detok.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    parts.append(detok.finish(final_text))
    return parts


@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_split_characters_never_stream_replacement(tok, chunk):
    for text in TEXTS:
        for ids in (tok.encode(text), byte_token_ids(tok, text)):  # merged tokens, then one byte each
            parts = stream_text(IncrementalDetokenizer(tok), ids, chunk)
            assert "".join(parts) == tok.decode(ids) == text
            assert not any("\ufffd" in p for p in parts), parts
    # the test means something: the tokenizer really splits characters over tokens
    assert any("\ufffd" in tok.decode([t]) for t in tok.encode(TEXTS[0]))


def test_text_arrives_as_soon_as_a_character_completes(tok):
    ids = byte_token_ids(tok, "a你🙂")  # 1 + 3 + 4 bytes
    detok = IncrementalDetokenizer(tok)
    assert [detok.push([t]) for t in ids] == ["a", "", "", "你", "", "", "", "🙂"]
    assert detok.finish() == ""


def test_random_token_sequences_join_to_decode(tok):
    """Arbitrary ids, invalid UTF-8 included: with or without the final text, the join is exact."""
    rng = random.Random(0)
    vocab = len(tok)
    for _ in range(60):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        expected = tok.decode(ids, skip_special_tokens=True)
        chunk = rng.choice([1, 1, 2, 5])
        assert "".join(stream_text(IncrementalDetokenizer(tok), ids, chunk)) == expected, ids
        assert "".join(stream_text(IncrementalDetokenizer(tok), ids, chunk, expected)) == expected, ids


def test_invalid_bytes_flush_past_the_cap():
    bt = ByteTokenizer()
    detok = IncrementalDetokenizer(bt, max_held_tokens=4)
    assert detok.push([0xE4]) == ""  # a lead byte: maybe a character to come
    assert detok.push([256]) == "" and detok.push([256]) == ""  # nothing new: still held
    assert detok.push([256]) == "\ufffd"  # 4 tokens with no new text: invalid, flushed
    assert detok.push([ord("x")]) == "x"
    # a lone continuation byte is invalid at once; a new lead byte ends the character before it
    detok = IncrementalDetokenizer(bt)
    assert detok.push([0x80, ord("a")]) == "\ufffda"
    assert detok.push([0xF0, 0x9F]) == "" and detok.push([0xE4]) == "\ufffd"
    assert detok.push([0xBD, 0xA0]) == "你"
    assert detok.finish() == ""
    # an incomplete character at the very end flushes at finish
    detok = IncrementalDetokenizer(bt)
    assert detok.push([ord("z"), 0xE4, 0xBD]) == "z"
    assert detok.finish() == "\ufffd"


def test_stop_strings_are_held_back(tok):
    ids = tok.encode("hello world, live stream")
    detok = IncrementalDetokenizer(tok, stop=["xyz", "stream!"])  # longest 7: hold back 6 characters
    sent = "".join(detok.push([t]) for t in ids)
    full = tok.decode(ids)
    assert sent == full[:len(full) - 6]
    # the engine cut the text before a stop string: finish sends exactly what is missing
    assert sent + detok.finish(full[:-3]) == full[:-3]


def test_final_text_with_a_stop_token_left_out(tok):
    ids = tok.encode("stop here")
    detok = IncrementalDetokenizer(tok)
    sent = "".join(detok.push([t]) for t in ids[:-1])
    # the last token ended the sequence and is not part of the text
    assert sent + detok.finish(tok.decode(ids[:-1]), ids[-1:]) == tok.decode(ids[:-1])
    assert detok.ids == ids


def test_sentencepiece_style_leading_space():
    """A Metaspace decoder drops the leading space of a text's first token; decoding a window that
    starts a few tokens back keeps the spaces between words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.train_from_iterator(["the live stream assistant answers the viewers of the stream"] * 3,
                            trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"], show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", clean_up_tokenization_spaces=False)
    ids = tok.encode("the viewers answer the live stream")
    assert "".join(stream_text(IncrementalDetokenizer(tok), ids)) == tok.decode(ids)
    assert " " in tok.decode(ids)


def test_no_tokenizer_gives_no_text():
    detok = IncrementalDetokenizer(None)
    assert detok.push([1, 2, 3]) == "" and detok.finish("") == "" and detok.ids == [1, 2, 3]
