"""EncoderCache: each media item's encoder output, kept by content hash (LRU within a byte budget), so an item is
encoded once however many prefill chunks, requests or session intervals use it."""
from collections import OrderedDict

from livemoe.engine.model.omni.thinker import EncodedMedia
from livemoe.engine.multimodal.media import MediaItem


class EncoderCache:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.entries: OrderedDict[int, EncodedMedia] = OrderedDict()
        self.num_bytes = 0
        self.hits = self.misses = 0

    def get(self, model, item: MediaItem, device) -> EncodedMedia:
        """The item's encoder output: cached, or encoded now (and cached when it fits the budget)."""
        found = self.entries.get(item.content_hash)
        if found is not None:
            self.hits += 1
            self.entries.move_to_end(item.content_hash)
            return found
        self.misses += 1
        data = item.data.to(device)
        encoded = model.encode_audio(data) if item.kind == "audio" else model.encode_vision(data, item.grid_thw)
        if encoded.embeds.shape[0] != item.num_tokens:
            raise RuntimeError(f"{item.name}: the encoder gave {encoded.embeds.shape[0]} rows for "
                               f"{item.num_tokens} placeholder tokens")
        size = sum(t.numel() * t.element_size() for t in (encoded.embeds, *encoded.deepstack))
        if size <= self.max_bytes:
            while self.num_bytes + size > self.max_bytes:
                _, old = self.entries.popitem(last=False)
                self.num_bytes -= sum(t.numel() * t.element_size() for t in (old.embeds, *old.deepstack))
            self.entries[item.content_hash] = encoded
            self.num_bytes += size
        return encoded

    def clear(self) -> None:
        """After a weight update: the cached outputs are the old encoders'."""
        self.entries.clear()
        self.num_bytes = 0
