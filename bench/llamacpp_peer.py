"""llama.cpp as the CPU decode peer, through llama-cpp-python's C API bindings (the `benchmark` extra; its install
compiles llama.cpp): a batch of sequences decoded greedily, one token per sequence per `llama_decode`, as
llama.cpp's `llama-batched-bench` does it (one shared context, a sequence id per stream, logits only for the
rows that sample). Greedy is the argmax of each row's logits, as our engine takes it.

`available()` says why it cannot run here (None: it can)."""
import ctypes
import time


def available() -> str | None:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (pip install 'livemoe[benchmark]')"
    return None


class LlamaCppPeer:
    """One GGUF model and one context for up to `n_seq` sequences of `n_ctx_per_seq` tokens each; flash_attn None is
    llama.cpp's default."""

    def __init__(self, gguf_path: str, n_threads: int, n_seq: int, n_ctx_per_seq: int, kv_f16: bool = False,
                 flash_attn: bool | None = None):
        import llama_cpp as L
        import numpy as np

        self.L, self.np = L, np
        L.llama_backend_init()
        L.llama_log_set(_QUIET, ctypes.c_void_p())
        mp = L.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.model = L.llama_model_load_from_file(gguf_path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf_path}")
        self.n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(self.model))
        cp = L.llama_context_default_params()
        cp.n_ctx = n_seq * n_ctx_per_seq
        cp.n_batch = cp.n_ubatch = max(cp.n_ctx, 512)
        cp.n_seq_max = n_seq
        cp.n_threads = cp.n_threads_batch = n_threads
        cp.kv_unified = True  # every sequence in one cache, as batched-bench runs
        cp.no_perf = True
        # None: llama.cpp's default (auto: on, on the CPU); its CPU flash attention rounds q/k/v to f16, so an
        # f32 model's logits move by ~1e-1 (off: ~1e-5 from ours)
        cp.flash_attn_type = -1 if flash_attn is None else int(flash_attn)
        cp.type_k = cp.type_v = 1 if kv_f16 else 0  # GGML_TYPE_F16 / F32: the KV in the weights' dtype, as ours
        self.ctx = L.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not make a context")
        self.n_seq = n_seq
        self.batch = L.llama_batch_init(cp.n_batch, 0, 1)

    def close(self) -> None:
        L = self.L
        if self.ctx:
            L.llama_batch_free(self.batch)
            L.llama_free(self.ctx)
            L.llama_model_free(self.model)
            self.ctx = self.model = None

    def _decode(self, rows: list[tuple[int, int, int, bool]]) -> list[int]:
        """rows (token, position, seq id, wants logits) in one llama_decode; the argmax of each row that wants them."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(rows):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(rows)
        rc = self.L.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
        out = []
        for i, row in enumerate(rows):
            if row[3]:
                ptr = self.L.llama_get_logits_ith(self.ctx, i)
                out.append(int(self.np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax()))
        return out

    def greedy(self, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
        """Greedy continuations of new_tokens for each prompt (one sequence each), and the seconds the
        new_tokens - 1 decode steps after the prefill took."""
        assert len(prompts) <= self.n_seq, (len(prompts), self.n_seq)
        self.L.llama_memory_clear(self.L.llama_get_memory(self.ctx), True)
        rows = [(t, p, s, p == len(prompt) - 1) for s, prompt in enumerate(prompts) for p, t in enumerate(prompt)]
        last = self._decode(rows)
        outs = [[t] for t in last]
        t0 = time.perf_counter()
        for _ in range(new_tokens - 1):
            rows = [(out[-1], len(prompt) + len(out) - 1, s, True) for s, (prompt, out) in enumerate(zip(prompts, outs))]
            for out, tok in zip(outs, self._decode(rows)):
                out.append(tok)
        return outs, time.perf_counter() - t0


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _QUIET(level, text, user_data):  # llama.cpp's loader logs a page per model: keep the benchmark's output readable
    return None
