"""MediaItem: one media item of a request, processed into its encoder's input and the number of placeholder tokens
it takes; MultimodalPrompt: prompt token ids with the items laid out over their placeholders."""
import hashlib
from dataclasses import dataclass, field

import torch

from livemoe.engine.model.omni.positions import MediaSpan


@dataclass(slots=True)
class MediaItem:
    kind: str  # audio | image | video
    data: torch.Tensor  # audio: log-mel [mel_bins, frames]; image / video: patches [t*h*w, patch_dim]
    num_tokens: int
    grid_thw: tuple[int, int, int] | None = None
    seconds_per_grid: float = 1.0
    name: str = ""  # how the request named it (for errors)
    content_hash: int = field(default=0)  # of the processed data: the encoder cache's and the prefix cache's key

    def __post_init__(self):
        if not self.content_hash:
            digest = hashlib.sha256(self.data.detach().cpu().contiguous().numpy().tobytes())
            digest.update(repr((self.kind, self.grid_thw, self.seconds_per_grid, tuple(self.data.shape))).encode())
            self.content_hash = int.from_bytes(digest.digest()[:8], "little") >> 1  # 63 bits: a positive int

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(slots=True)
class PlacedMedia:
    """A MediaItem at its place in a prompt: tokens [offset, offset + item.num_tokens) are its placeholders."""
    item: MediaItem
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.item.num_tokens

    def span(self) -> MediaSpan:
        it = self.item
        return MediaSpan(it.kind, self.offset, it.num_tokens, it.grid_thw, it.seconds_per_grid)


@dataclass(slots=True)
class MultimodalPrompt:
    """What LLM.generate / AsyncLLM.add_request take for a prompt with media (LLM.chat and the server make it from
    content parts)."""
    prompt_ids: list[int]
    media: list[PlacedMedia]

    def __len__(self) -> int:
        return len(self.prompt_ids)


def split_media(prompt):
    """(the prompt without its media, its PlacedMedia list or None)."""
    if isinstance(prompt, MultimodalPrompt):
        return prompt.prompt_ids, prompt.media
    return prompt, None
