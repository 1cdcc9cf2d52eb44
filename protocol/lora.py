"""A LoRA adapter as every layer names it: `AdapterRef(name, path)`.

Clients name an adapter by `name` (a request's `model`); the frontend keeps the
registry of names and the directory each was loaded from, and every message that
carries a request for one (the Generate call, the remote-prefill message) carries both,
so any worker can load it on demand. The pair is the adapter's identity in the
block-hash chain (`hash_key`, after the cache salt in the first block): KV computed
with one adapter is never a prefix hit for another or for the base model, and an
adapter unloaded and loaded again from another directory under the same name does not
meet the old one's cache.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from protocol.errors import InvalidInput

# what a name may be: it travels in URLs, metrics labels and model lists
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,127}")
MAX_PATH = 4096


@dataclass(frozen=True)
class AdapterRef:
    name: str
    path: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not NAME.fullmatch(self.name):
            raise InvalidInput(
                f"LoRA adapter name {self.name!r}: 1-128 characters of letters, digits and "
                "._:/@+- (starting with a letter or digit)"
            )
        if (
            not isinstance(self.path, str)
            or not 0 < len(self.path) <= MAX_PATH
            or "\x00" in self.path
        ):
            raise InvalidInput(f"LoRA adapter {self.name!r}: its path must be 1-{MAX_PATH} "
                               "characters")  # fmt: skip

    @property
    def hash_key(self) -> bytes:
        """What the adapter adds to the first block's hash (see protocol.kv_layout)."""
        return self.name.encode() + b"\x00" + self.path.encode()

    @classmethod
    def of(cls, name: str | None, path: str | None) -> AdapterRef | None:
        """From a message's two fields: None when both are empty (the base model)."""
        if not name and not path:
            return None
        if not name or not path:
            raise InvalidInput("a LoRA adapter needs both its name and its path")
        return cls(name, path)
