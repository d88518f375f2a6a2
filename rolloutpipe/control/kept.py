"""What a process wrote to the store and a reader may still need, written back where an outsider changed it.

Anyone who reaches the store's port can overwrite or delete any key: the TCPStore has no authentication. Sealing makes
a forged value harmless to read (readers refuse it and wait for the genuine one: control/transport.py), but the
genuine value is then gone. So a writer keeps each value it wrote until it deletes the key itself, and every
heart-beat (control/liveness.py) checks them and writes back any that an outsider overwrote. An outsider's write then
costs a reader a heart-beat or so, not the run; the price is a read of what a process keeps, per heart-beat: a step's
handles and inline payloads, a few records (heart-beats themselves are rewritten every beat and not kept). A key found
missing is not written back, and no longer kept: the run's own processes delete what they consumed, also keys another
process wrote (the trainer forgets the rollout's handles); an outsider who deletes a key a reader still waits for
stalls the run.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class Kept:
    """One process's kept values, shared by all its store clients (``Transport.connect_another``)."""

    def __init__(self) -> None:
        self._values: dict[str, bytes] = {}
        self.lock = threading.Lock()
        """Held around a keep, a delete and a heal of one key: a key its writer deletes is never written back."""
        self.num_healed = 0

    def keep(self, key: str, value: bytes | str) -> None:
        """(Under ``lock``, with the store write.)"""
        self._values[key] = value.encode() if isinstance(value, str) else bytes(value)

    def drop(self, key: str) -> None:
        """(Under ``lock``, with the store delete.)"""
        self._values.pop(key, None)

    def heal(self, store) -> int:
        """Write back every kept value that ``store`` (a BoundedStore) does not hold as written; returns how many.
        No call waits for a key: another process may delete one at any moment (its reader, having consumed it)."""
        healed = 0
        for key in list(self._values):
            with self.lock:
                value = self._values.get(key)
                if value is None:
                    continue
                current = store.get_now(key)
                if current is None:
                    self._values.pop(key)  # consumed and deleted (by its reader, maybe): no longer kept
                    continue
                if current == value or store.compare_set(key, current, value) != value:
                    continue  # as written; or deleted or rewritten since the read: the next beat sees which
            healed += 1
        if healed:
            self.num_healed += healed
            log.warning("wrote back %d store value(s) that a process without this run's secret overwrote (%d so far)",
                        healed, self.num_healed)
        return healed
