"""A tiny byte-level BPE tokenizer (trained here in well under a second, nothing downloaded) and a
matching tiny checkpoint, so the text paths of the decoder meet what real Qwen tokenizers do: a
multi-byte character (CJK, emoji) split over several tokens, special tokens, a chat template.

`make_text_checkpoint(path)` -> (dir, tokenizer): a random tiny Qwen3 from `tiny_models` whose
vocab_size equals the tokenizer's, saved with the tokenizer beside it.
`make_cycle_checkpoint(path, text)` -> (dir, tokenizer, cycle ids): a model that greedily continues the
byte tokens of `text` in a cycle, so its output splits every multi-byte character over tokens.
"""
import torch

SPECIALS = ["<|pad|>", "<|bos|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0..4; eos 2
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "The quick brown fox jumps over the lazy dog. A live stream assistant answers viewers as they ask.",
    "Streaming decoders send each token as soon as it exists; the client joins the deltas.",
    "直播助手回答观众的问题。你好，世界！今天的天气很好。",
    "ライブ配信のアシスタントです。こんにちは、世界。",
    "Emoji time 🙂🚀🎉 and accents: café, naïve, résumé, 😀 👍.",
    "Numbers 0123456789 and symbols: +-*/=<>()[]{} #@&%$!?",
]


def train_tokenizer(vocab_size: int = 320):
    """A byte-level BPE over CORPUS (256 byte tokens + merges + SPECIALS), as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>",
                                   eos_token="<|endoftext|>", clean_up_tokenization_spaces=False)
    fast.chat_template = CHAT_TEMPLATE
    assert [fast.convert_tokens_to_ids(s) for s in SPECIALS] == list(range(len(SPECIALS)))
    return fast


def byte_token_ids(tokenizer, text: str) -> list[int]:
    """One token per UTF-8 byte of text (the byte-level alphabet's tokens), whatever the merges say."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode  # GPT-2's byte alphabet, as ByteLevel uses

    table = bytes_to_unicode()
    return [tokenizer.convert_tokens_to_ids(table[b]) for b in text.encode("utf-8")]


def make_text_checkpoint(path, moe: bool = False, seed: int = 0, **overrides):
    from tiny_models import hf_model

    tokenizer = train_tokenizer()
    model = hf_model(moe, seed, vocab_size=len(tokenizer), **overrides)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer


def make_cycle_checkpoint(path, text: str = "aé你b🙂界", seed: int = 0):
    """A dense tiny model with no layer contributions (o_proj and down_proj zeroed: the final hidden
    state is the token's embedding), whose lm_head maps each byte token of `text` to the next one.
    The byte tokens must be distinct; greedy decoding then repeats `text` from where a prompt ends."""
    from tiny_models import hf_model

    tokenizer = train_tokenizer()
    cycle = byte_token_ids(tokenizer, text)
    assert len(set(cycle)) == len(cycle), f"{text!r} repeats a byte; the cycle would be ambiguous"
    model = hf_model(False, seed, vocab_size=len(tokenizer))
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, 1.0)
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
        head = model.lm_head.weight
        head.zero_()
        for cur, nxt in zip(cycle, cycle[1:] + cycle[:1]):
            head[nxt] = 4.0 * emb[cur]  # logit(nxt | cur) ~ 4 * |e_cur|^2 / rms >> any cross term
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path), tokenizer, cycle
