"""Where media sit in a prompt and the multimodal rotary positions (time, height, width) they get.

Every token that is not a placeholder is text: it takes the next position on all three axes. An audio item's
tokens count on like text (one per ~80 ms of sound). An image or video item's tokens take (t, h, w) on its merged
patch grid, the time axis in units of 1 / position_id_per_seconds s (a video's frames are time-aligned with audio
at the same rate), all offset by the position where the item starts; the next token follows the largest position
the item used. These are transformers' get_rope_index for one sequence, written from the spans the engine itself
laid out rather than by searching the tokens for start markers.
"""
from dataclasses import dataclass

import torch

from livemoe.engine.model.omni.config import OmniConfig

MEDIA_KINDS = ("audio", "image", "video")


@dataclass(frozen=True, slots=True)
class MediaSpan:
    kind: str  # audio | image | video
    offset: int  # the item's first placeholder token in the prompt
    length: int  # its placeholder tokens (= the encoder's output rows)
    grid_thw: tuple[int, int, int] | None = None  # vision: the patch grid before merging
    seconds_per_grid: float = 1.0  # video: seconds per temporal patch

    @property
    def end(self) -> int:
        return self.offset + self.length


def audio_token_count(frames: int, n_window: int) -> int:
    """The audio encoder's output rows for `frames` mel frames: chunks of 2*n_window frames, each through three
    stride-2 convolutions."""
    def after_convs(n: int) -> int:
        for _ in range(3):
            n = (n - 1) // 2 + 1
        return n
    chunk = 2 * n_window
    full, rest = divmod(frames, chunk)
    return full * after_convs(chunk) + (after_convs(rest) if rest else 0)


def vision_token_count(grid_thw: tuple[int, int, int], merge: int) -> int:
    t, h, w = grid_thw
    return t * (h // merge) * (w // merge)


def span_positions(span: MediaSpan, start: float, omni: OmniConfig) -> torch.Tensor:
    """[3, span.length] positions of one item's tokens, the first at `start`."""
    if span.kind == "audio":
        return torch.arange(span.length, dtype=torch.float64).expand(3, -1) + start
    t, h, w = span.grid_thw
    merge = omni.spatial_merge_size
    gh, gw = h // merge, w // merge
    # in float32 and in transformers' order of operations, so the positions are its to the bit
    seconds = torch.tensor(span.seconds_per_grid if span.kind == "video" else 1.0, dtype=torch.float32)
    t_index = (torch.arange(t).float() * seconds * omni.position_id_per_seconds).double()
    grid = torch.stack([t_index.view(-1, 1, 1).expand(t, gh, gw),
                        torch.arange(gh, dtype=torch.float64).view(1, -1, 1).expand(t, gh, gw),
                        torch.arange(gw, dtype=torch.float64).view(1, 1, -1).expand(t, gh, gw)])
    return grid.reshape(3, -1) + start


def mrope_positions(num_tokens: int, spans: list[MediaSpan], omni: OmniConfig) -> tuple[torch.Tensor, float]:
    """-> (positions [3, num_tokens] float64, delta): the prompt's positions and what a token after the prompt adds
    to its index (its position is index + delta on all three axes). Spans must be in order and not overlap."""
    parts, next_pos, cursor = [], 0.0, 0
    for span in spans:
        if span.offset < cursor or span.end > num_tokens:
            raise ValueError(f"media span {span} overlaps another or leaves the prompt ({num_tokens} tokens)")
        text = span.offset - cursor
        parts.append(torch.arange(text, dtype=torch.float64).expand(3, -1) + next_pos)
        next_pos += text
        pos = span_positions(span, next_pos, omni)
        parts.append(pos)
        next_pos = float(pos.max()) + 1 if span.length else next_pos
        cursor = span.end
    parts.append(torch.arange(num_tokens - cursor, dtype=torch.float64).expand(3, -1) + next_pos)
    positions = torch.cat(parts, dim=1)
    last = float(positions.max()) if num_tokens else -1.0
    return positions, last + 1 - num_tokens
