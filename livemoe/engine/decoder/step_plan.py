"""StepPlan: one engine step's inputs on the host, as ModelRunner.plan makes them from the scheduler's
output: everything a forward needs and nothing of the requests. Tensor-parallel workers receive it from
rank 0 (livemoe/engine/decoder/workers.py) and run the same forward; `frames` / `from_frames` is its wire form
(a fixed header and the two int arrays' raw bytes: no pickling on the hot path)."""
import array
import struct
from dataclasses import dataclass

_HEADER = struct.Struct("<7q")  # num_seqs, width, max_seqlen_q, is_decode, max_context_len, len(longs), len(ints)


@dataclass(slots=True)
class StepPlan:
    longs: array.array  # "q": input_ids [N] + positions [N] + slot_mapping [N]
    ints: array.array  # "i": context_lens [S] + cu_seqlens_q [S + 1] + block_tables [S, width] (-1 padded)
    sample_rows: list[int]  # rows of N whose logits are computed (a sequence's last token)
    num_seqs: int
    width: int  # block-table columns
    max_seqlen_q: int
    is_decode: bool
    max_context_len: int
    sampling_seqs: list[int] | None = None  # indices into the scheduled seqs (rank 0 only: not sent)
    # a prefill step of sequences with media (the Omni thinker, one rank only: not sent): multimodal rotary positions
    # [3 * N] (time, height, width rows) and the media pieces [(flat row, PlacedMedia, lo, hi)] the step computes
    mrope: array.array | None = None
    media: list | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.longs) // 3

    def split(self, longs, ints) -> tuple:
        """The step's tensors as views of `longs` and `ints` (tensors holding this plan's two arrays, in order):
        (input_ids [N], positions [N], slot_mapping [N], context_lens [S], cu_seqlens_q [S + 1], block_tables
        [S, width])."""
        S, N = self.num_seqs, self.num_tokens
        return (longs[:N], longs[N:2 * N], longs[2 * N:], ints[:S], ints[S:2 * S + 1],
                ints[2 * S + 1:].view(S, self.width))

    def frames(self) -> list[bytes]:
        header = _HEADER.pack(self.num_seqs, self.width, self.max_seqlen_q, int(self.is_decode),
                              self.max_context_len, len(self.longs), len(self.ints))
        return [header, self.longs.tobytes(), self.ints.tobytes(), array.array("q", self.sample_rows).tobytes()]

    @classmethod
    def from_frames(cls, frames) -> "StepPlan":
        header, longs_b, ints_b, rows_b = (memoryview(f) for f in frames)
        num_seqs, width, max_seqlen_q, is_decode, max_context_len, n_longs, n_ints = _HEADER.unpack(header)
        longs, ints, rows = array.array("q"), array.array("i"), array.array("q")
        longs.frombytes(longs_b)
        ints.frombytes(ints_b)
        rows.frombytes(rows_b)
        assert (len(longs), len(ints)) == (n_longs, n_ints), "a truncated step plan"
        return cls(longs=longs, ints=ints, sample_rows=rows.tolist(), num_seqs=num_seqs, width=width,
                   max_seqlen_q=max_seqlen_q, is_decode=bool(is_decode), max_context_len=max_context_len)
