"""The store of /v1/responses answers (store=true, the default): what GET and DELETE
/v1/responses/{id} read, and what previous_response_id continues.

In memory, bounded by a number of responses (--max-stored-responses, 1,024 by default): past
it the least recently used response (created, retrieved or continued) is evicted. Each entry
holds the Response object as it was answered and the conversation it ended, as chat messages
(the previous turns, the input, the output; without the instructions, which do not carry
over to the next response, as OpenAI has it). Thread-safe: responses are stored from the
encoding threads and read from the prepare threads.
"""

from __future__ import annotations

import collections
import dataclasses
import threading


@dataclasses.dataclass(frozen=True)
class StoredResponse:
    response: dict  # the Response object
    messages: tuple[dict, ...]  # the conversation it ended, as chat messages


class ResponseStore:
    def __init__(self, max_entries: int) -> None:
        if not isinstance(max_entries, int) or max_entries < 1:
            raise ValueError(f"max_stored_responses must be a positive integer, got "
                             f"{max_entries!r}.")
        self.max_entries = max_entries
        self._entries: collections.OrderedDict[str, StoredResponse] = \
            collections.OrderedDict()
        self._lock = threading.Lock()
        self.evicted = 0  # responses dropped to keep the cap

    def put(self, response_id: str, entry: StoredResponse) -> None:
        with self._lock:
            self._entries[response_id] = entry
            self._entries.move_to_end(response_id)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
                self.evicted += 1

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry (now the most recently used), or None."""
        with self._lock:
            entry = self._entries.get(response_id)
            if entry is not None:
                self._entries.move_to_end(response_id)
            return entry

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._entries.pop(response_id, None) is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
