"""The store of /v1/responses answers (store=true, the default): what GET and DELETE
/v1/responses/{id} read, and what previous_response_id continues.

In memory, bounded by a number of responses (--max-stored-responses, 1,024 by default) and
by their size (--max-stored-response-bytes, 256 MiB by default, counted as entry_size
measures an entry: its text and numbers): past either, the least recently used responses
(created, retrieved or continued) are evicted; one larger than the whole byte bound by
itself is not kept. Each entry holds the Response object as it was answered and the
conversation it ended, as chat messages (the turns the response was generated from, which
truncation "auto" may have shortened, then its output; without the instructions, which do
not carry over to the next response, as OpenAI has it). Thread-safe: responses are stored
from the encoding threads and read from the prepare threads.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading

logger = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 256 * 2**20
_OVERHEAD = 16  # bytes counted for each number, container and key beside its text


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object
    messages: tuple[dict, ...]  # the conversation it ended, as chat messages


def entry_size(value) -> int:
    """What an entry counts against the byte bound: the UTF-8 bytes of its strings (the
    length in characters, a lower bound that costs nothing to take) and _OVERHEAD for every
    other value, container and dict key."""
    if isinstance(value, str):
        return len(value) + _OVERHEAD
    if isinstance(value, dict):
        return _OVERHEAD + sum(entry_size(k) + entry_size(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return _OVERHEAD + sum(entry_size(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return entry_size(value.response) + entry_size(value.messages)
    return _OVERHEAD


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        for name, value in (("max_stored_responses", max_entries),
                            ("max_stored_response_bytes", max_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: collections.OrderedDict[str, tuple[StoredResponse, int]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0  # the entries' sizes (entry_size), together
        self.evicted = 0  # responses dropped to keep the bounds

    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Keep the entry (evicting the least recently used past the bounds); False when it
        is larger than max_bytes by itself (then it is not kept)."""
        size = entry_size(entry)
        if size > self.max_bytes:
            logger.warning("Response %s is not stored: it takes %d bytes, more than "
                           "--max-stored-response-bytes (%d)", response_id[:300], size,
                           self.max_bytes)
            self.delete(response_id)
            return False
        with self._lock:
            old = self._entries.pop(response_id, None)
            if old is not None:
                self.bytes -= old[1]
            self._entries[response_id] = (entry, size)
            self.bytes += size
            while len(self._entries) > self.max_entries or self.bytes > self.max_bytes:
                _, (_, dropped) = self._entries.popitem(last=False)
                self.bytes -= dropped
                self.evicted += 1
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None."""
        with self._lock:
            kept = self._entries.get(response_id)
            if kept is None:
                return None
            self._entries.move_to_end(response_id)
            return kept[0]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            kept = self._entries.pop(response_id, None)
            if kept is not None:
                self.bytes -= kept[1]
            return kept is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
