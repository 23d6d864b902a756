"""`livemoe export-gguf`: the file's metadata and tensors read back with the gguf package, and the file loaded by
llama.cpp (llama-cpp-python) decoding the same greedy tokens as our engine, on the committed student and a random
MoE, and a dense model with tied embeddings (qwen3, no output tensor), f32 and f16."""
import os

import numpy as np
import pytest
import torch

from livemoe.engine.model.loader import load_model
from tiny_models import make_checkpoint

gguf = pytest.importorskip("gguf", reason="the gguf package (the `gguf` extra) is not installed")

from livemoe.engine.model.gguf_export import export_gguf, main  # noqa: E402

STUDENT = os.path.join(os.path.dirname(__file__), "..", "..", "livemoe", "train", "assets", "student")


@pytest.fixture(scope="module")
def random_moe(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("gguf") / "moe", moe=True, seed=4)
    return path


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_export_reads_back(random_moe, tmp_path, dtype):
    dst = export_gguf(random_moe, str(tmp_path / "m.gguf"), dtype)
    reader = gguf.GGUFReader(dst)
    arch = reader.fields["general.architecture"]
    assert bytes(arch.parts[arch.data[0]]).decode() == "qwen3moe"
    model = load_model(random_moe, dtype=torch.float32, device="cpu")
    tensors = {t.name: t for t in reader.tensors}
    cfg = model.config
    assert len(tensors) == 3 + cfg.num_hidden_layers * 12
    inter = cfg.moe_intermediate_size
    want = {"token_embd.weight": model.model.embed_tokens.weight,
            "blk.1.attn_q.weight": model.model.layers[1].self_attn.q_proj.weight,
            "blk.2.ffn_gate_exps.weight": model.model.layers[2].mlp.experts.gate_up_proj[:, :inter],
            "blk.2.ffn_up_exps.weight": model.model.layers[2].mlp.experts.gate_up_proj[:, inter:],
            "blk.0.ffn_down_exps.weight": model.model.layers[0].mlp.experts.down_proj,
            "blk.0.attn_k_norm.weight": model.model.layers[0].self_attn.k_norm.weight}
    for name, t in want.items():
        got = np.asarray(tensors[name].data).reshape(t.shape)  # GGUFReader gives numpy's row-major order
        expect = t.detach().numpy()
        if dtype == "f16" and t.dim() > 1:
            expect = expect.astype(np.float16)
        np.testing.assert_array_equal(got, expect, err_msg=name)
    assert tensors["blk.0.attn_k_norm.weight"].data.dtype == np.float32  # norms stay f32


def test_export_refuses_what_llama_cpp_computes_otherwise(tmp_path):
    path, _ = make_checkpoint(tmp_path / "m", moe=True, norm_topk_prob=False)
    with pytest.raises(ValueError, match="norm_topk_prob"):
        export_gguf(path, str(tmp_path / "m.gguf"))
    assert main([path, str(tmp_path / "m.gguf")]) == 2
    with pytest.raises(ValueError, match="--dtype"):
        export_gguf(path, str(tmp_path / "m.gguf"), "q4")


@pytest.fixture(scope="module")
def dense_tied(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("gguf") / "dense", moe=False, seed=5, tie_word_embeddings=True)
    return path


@pytest.mark.parametrize("which", ["student", "random_moe", "dense_tied"])
@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_llama_cpp_decodes_our_greedy_tokens(which, dtype, random_moe, dense_tied, tmp_path):
    from bench import llamacpp_peer

    if llamacpp_peer.available() is not None:
        pytest.skip(llamacpp_peer.available())
    from livemoe.engine.llm import LLM
    from livemoe.engine.sampling.params import SamplingParams

    src = {"student": STUDENT, "random_moe": random_moe, "dense_tied": dense_tied}[which]
    dst = export_gguf(src, str(tmp_path / "m.gguf"), dtype)
    llm = LLM(src, dtype=torch.float32 if dtype == "f32" else torch.float16, device="cpu", use_tqdm=False)
    vocab = llm.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 11, 17)]
    new = 16
    ours = [o.outputs[0].token_ids for o in
            llm.generate(prompts, SamplingParams(temperature=0, max_tokens=new, ignore_eos=True))]
    # f32: without llama.cpp's CPU flash attention, which rounds q/k/v to f16
    peer = llamacpp_peer.LlamaCppPeer(dst, n_threads=1, n_seq=len(prompts), n_ctx_per_seq=64, kv_f16=dtype == "f16",
                                      flash_attn=False if dtype == "f32" else None)
    try:
        theirs, _ = peer.greedy(prompts, new)
    finally:
        peer.close()
    if dtype == "f32":
        assert theirs == ours
    else:  # 16-bit: llama.cpp rounds activations to f16 inside its matmuls, we accumulate in fp32
        assert [t[0] for t in theirs] == [t[0] for t in ours]
