"""MediaLayout: a prompt's media as the engine core keeps them with its sequences: the placed items, the prompt's
multimodal rotary positions, and the keys that make prefix caching see media content.

Prefix-cache keys: a placeholder token's key is a negative number derived from its item's content hash (token ids
are never negative), so two prompts with different media of the same length hash to different blocks, and the same
media at the same place (a repeated image, a live session's earlier intervals) hits the cache.
"""
import torch

from livemoe.engine.model.omni.config import OmniConfig
from livemoe.engine.model.omni.positions import mrope_positions
from livemoe.engine.multimodal.media import PlacedMedia


class MediaLayout:
    __slots__ = ("media", "positions", "rope_delta", "num_prompt_tokens")

    def __init__(self, media: list[PlacedMedia], num_prompt_tokens: int, omni: OmniConfig):
        self.media = sorted(media, key=lambda m: m.offset)
        positions, delta = mrope_positions(num_prompt_tokens, [m.span() for m in self.media], omni)
        assert delta == int(delta), delta  # MediaProcessor keeps video time steps whole
        self.positions = positions.long()  # [3, num_prompt_tokens]
        self.rope_delta = int(delta)
        self.num_prompt_tokens = num_prompt_tokens

    def overlay_keys(self, keys: list[int], start: int) -> None:
        """keys: token ids of tokens [start, start + len(keys)); placeholders become their item's key, in place."""
        end = start + len(keys)
        for m in self.media:
            if m.offset >= end:
                break
            lo, hi = max(m.offset, start), min(m.end, end)
            if lo < hi:
                keys[lo - start:hi - start] = [-1 - m.item.content_hash] * (hi - lo)

    def positions_of(self, start: int, end: int, delta: int) -> torch.Tensor:
        """[3, end - start] positions of tokens [start, end): the prompt's, then index + delta past it."""
        head = self.positions[:, start:min(end, self.num_prompt_tokens)]
        if end <= self.num_prompt_tokens:
            return head
        tail = torch.arange(max(start, self.num_prompt_tokens), end).expand(3, -1) + delta
        return torch.cat([head, tail], dim=1)

    def overlapping(self, start: int, end: int) -> list[PlacedMedia]:
        return [m for m in self.media if m.offset < end and m.end > start]
