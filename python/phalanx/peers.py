"""Which groups of the last quorum this rank cannot reach, for the lighthouse.

A cut between two hosts that both still reach the lighthouse (a "bridge" cut) leaves
every group alive and beating, and their collectives timing out, step after step,
for as long as the cut lasts. So after a step whose collectives or rendezvous failed
without the lighthouse naming a dead group, the rank asks each peer of that quorum's
rendezvous store for a key, with a short deadline, all at once; the groups that did
not answer ride on its next quorum requests, and the lighthouse leaves one of each
such pair out (`quorum::connected`). Until they answer again, a thread beside the
training thread asks them once a second, so that the rank reports them reachable
again soon after the cut ends, without waiting on the training thread.

>>> reach = PeerReach(probe=lambda address: address != "10.0.0.2:1")
>>> reach.step_failed({"g1": "10.0.0.1:1", "g2": "10.0.0.2:1"})
>>> reach.unreachable()
['g2']
>>> reach.close()
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor

from phalanx import _core

#: How long a peer's store has to answer: a store that answers at all does in
#: milliseconds; a cut one never does.
PROBE_TIMEOUT_S = 1.0
#: How often peers that did not answer are asked again.
PROBE_EVERY_S = 1.0
#: The most peers asked after one failed step (the lighthouse takes no more reports).
MAX_PROBED = 64
#: How the lighthouse words a quorum request it left out (`LighthouseState::evaluate`).
LEFT_OUT = "left out of quorum"


def store_answers(address: str, token: str | None, timeout: float = PROBE_TIMEOUT_S) -> bool:
    """Whether the rendezvous store at `address` answers within `timeout`: a refused
    token is an answer too (the peer is reachable; the token is another matter)."""
    try:
        store = _core.StoreClient(address, token=token, timeout=timeout, connect_timeout=timeout)
        store.check([_core.STORE_REPLICA_ID_KEY])
    except PermissionError:
        return True
    except (ConnectionError, TimeoutError, OSError, ValueError):
        return False
    return True


class PeerReach:
    """The peers this rank could not reach, by replica id, asked again until they
    answer. `probe(address)` tells whether the store at `address` answers."""

    def __init__(self, probe: Callable[[str], bool]):
        self._probe = probe
        self._lock = threading.Lock()
        #: Replica id -> store address, of the peers that did not answer.
        self._unreachable: dict[str, str] = {}
        self._wake = threading.Event()
        #: Set whenever a peer is found unreachable or reachable again.
        self._changed = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    def step_failed(self, peers: Mapping[str, str]) -> None:
        """A step's collectives failed with no group named dead: asks every peer
        (replica id -> store address) at once, and waits for the answers (at most
        the probe's deadline)."""
        asked = dict(list(peers.items())[:MAX_PROBED])
        if not asked:
            return
        with ThreadPoolExecutor(len(asked), thread_name_prefix="phalanx-reach") as pool:
            answers = dict(zip(asked, pool.map(self._probe, asked.values()), strict=True))
        with self._lock:
            before = set(self._unreachable)
            for replica_id, answered in answers.items():
                if answered:
                    self._unreachable.pop(replica_id, None)
                else:
                    self._unreachable[replica_id] = asked[replica_id]
            if set(self._unreachable) != before:
                self._changed.set()
            if self._unreachable and self._thread is None and not self._closed:
                self._thread = threading.Thread(
                    target=self._ask_again, name="phalanx-reach", daemon=True
                )
                self._thread.start()

    def unreachable(self) -> list[str]:
        """The peers that have not answered since they last failed to, in order."""
        with self._lock:
            return sorted(self._unreachable)

    def left_out(self) -> None:
        """The lighthouse left this group out of a round (it and a member cannot reach
        each other): waits until this rank's view of its peers changes, or a probe
        interval, before the group asks again, rather than ask at every round."""
        self._changed.clear()
        self._changed.wait(PROBE_EVERY_S)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            thread = self._thread
        self._wake.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(PROBE_TIMEOUT_S + PROBE_EVERY_S)

    def _ask_again(self) -> None:
        while not self._wake.wait(PROBE_EVERY_S):
            with self._lock:
                asked = dict(self._unreachable)
            answered = {replica_id for replica_id, a in asked.items() if self._probe(a)}
            with self._lock:
                for replica_id in answered:
                    self._unreachable.pop(replica_id, None)
                if answered:
                    self._changed.set()
                if not self._unreachable or self._closed:
                    self._thread = None
                    return
