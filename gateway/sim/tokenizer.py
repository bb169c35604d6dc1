"""The emulators' tokenizer: cheap, deterministic and documented, not any model's real vocabulary.

Rule: a prompt is split with one regular expression into pieces, each piece is one token:
  * an optional single leading space followed by 1-6 ASCII letters (longer words become several tokens),
  * an optional single leading space followed by 1-3 digits,
  * an optional single leading space followed by one other non-space character,
  * a run of whitespace (newlines, tabs, extra spaces).
Concatenating the pieces gives the text back exactly. A piece's id is ``crc32(piece) % 31_997 + 3`` (ids 0-2 are
reserved: 0 unknown, 1 BOS, 2 EOS, as in Llama 2's 32,000-entry vocabulary). Prompts start with BOS.
The same text always gives the same ids, in every process, so prefix caches and usage counts are exact.
"""

from __future__ import annotations

import re
import zlib

BOS_ID = 1
EOS_ID = 2
VOCAB_SIZE = 32_000

_PIECE = re.compile(r" ?[A-Za-z]{1,6}| ?[0-9]{1,3}| ?[^\sA-Za-z0-9]|\s+")


class Tokenizer:
    """Text -> pieces -> ids, with a bounded memo of piece ids (ids are reversible only for pieces seen)."""

    def __init__(self, memo_size: int = 200_000) -> None:
        self._ids: dict[str, int] = {}
        self._pieces: dict[int, str] = {}
        self._memo_size = memo_size

    @staticmethod
    def pieces(text: str) -> list[str]:
        return _PIECE.findall(text)

    def piece_id(self, piece: str) -> int:
        tid = self._ids.get(piece)
        if tid is None:
            tid = zlib.crc32(piece.encode()) % (VOCAB_SIZE - 3) + 3
            if len(self._ids) >= self._memo_size:
                self._ids.clear()
                self._pieces.clear()
            self._ids[piece] = tid
            self._pieces[tid] = piece
        return tid

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = [self.piece_id(p) for p in _PIECE.findall(text)]
        return [BOS_ID, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        """Best effort: pieces this tokenizer has seen; special ids decode to nothing, unknown ids to '?'."""
        return "".join(self._pieces.get(i, "" if i < 3 else "?") for i in ids)
