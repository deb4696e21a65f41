"""Block hashes for the prefix cache.

Block `b` of a request covers tokens [b*T, (b+1)*T). Its hash chains the
previous block's hash, its token ids and extra keys (the content hash of every
image whose placeholder tokens start in the block), so two blocks share a
hash only when their whole prefixes match. Every spec of the text stream
caches its page for block `b` under the same hash; image specs key their pages
by (image hash, page index) because their content depends on the image alone.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class ImageInput:
    """An image of a request: `num_tokens` image tokens, referenced at `offset`.

    For vision-embedding models the placeholders occupy text positions
    [offset, offset + num_tokens); for cross-attention models `offset` is the
    position of the image marker and the image tokens live outside the text.
    """

    content_hash: Hashable
    offset: int
    num_tokens: int

    def __post_init__(self) -> None:
        if self.offset < 0 or self.num_tokens <= 0:
            raise ValueError(f"bad image: offset {self.offset}, num_tokens {self.num_tokens}")


def extend_block_hashes(
    hashes: list[int],
    tokens: Sequence[int],
    block_size: int,
    images: Sequence[ImageInput] = (),
    upto: int | None = None,
) -> None:
    """Append the hashes of every full block of tokens[:upto] not hashed yet."""
    nfull = (len(tokens) if upto is None else min(upto, len(tokens))) // block_size
    b = len(hashes)
    prev = hashes[-1] if hashes else 0
    while b < nfull:
        lo = b * block_size
        hi = lo + block_size
        extra = tuple(im.content_hash for im in images if lo <= im.offset < hi) if images else ()
        prev = hash((prev, tuple(tokens[lo:hi]), extra))
        hashes.append(prev)
        b += 1


def image_page_key(image: ImageInput, index: int) -> tuple[str, Hashable, int]:
    return ("image", image.content_hash, index)
