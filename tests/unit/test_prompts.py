"""livemoe.engine.text.prompts.encode_text and the IncrementalDetokenizer's decode: the fast paths through the tokenizer's
Rust backend give exactly what transformers' encode and decode give."""
import pytest

from livemoe.engine.text.detokenizer import IncrementalDetokenizer
from livemoe.engine.text.prompts import encode_text
from livemoe.engine.errors import RequestError
from tiny_tokenizer import train_tokenizer

TEXTS = ["", "hello world", "  leading and trailing  ", "直播 🙂 é\n\ttabs", "<|im_start|>user hi<|im_end|>",
         "x" * 3000]


@pytest.mark.parametrize("special", [True, False])
def test_encode_text_equals_transformers_encode(special):
    tok = train_tokenizer()
    assert tok.is_fast and tok.backend_tokenizer is not None  # else the fast path is not what is tested
    assert len(TEXTS) > 0
    for text in TEXTS:
        assert encode_text(tok, text, add_special_tokens=special) == tok.encode(text, add_special_tokens=special)


def test_encode_text_with_other_options_and_bad_unicode():
    tok = train_tokenizer()
    assert encode_text(tok, "a b c d e", truncation=True, max_length=2) == tok.encode("a b c d e", truncation=True,
                                                                                      max_length=2)
    with pytest.raises(RequestError, match="not valid Unicode"):
        encode_text(tok, "bad \ud800 surrogate")


@pytest.mark.parametrize("skip", [True, False])
def test_detokenizer_decode_equals_transformers_decode(skip):
    tok = train_tokenizer()
    detok = IncrementalDetokenizer(tok, skip_special_tokens=skip)
    assert detok.backend is not None  # the fast path is what is tested
    ids = [i for text in TEXTS for i in tok.encode(text)] + [tok.eos_token_id, tok.bos_token_id]
    assert len(ids) > 0
    for end in range(0, len(ids), 7):
        assert detok._decode(ids[:end]) == tok.decode(ids[:end], skip_special_tokens=skip)
    tok.clean_up_tokenization_spaces = True  # transformers' own decode then (it may change the text)
    assert IncrementalDetokenizer(tok).backend is None
