"""The front's side of the shared rings: a memfd per worker that carries its big frames both ways.

workers/rings.py says why and how. Here the front offers a worker its
rings with the first big frame it sends it, copies big request frames in
and big reply frames out, and gives a worker's ring pages back to the OS
once its big frames have stopped for QUIET_SECONDS and it has no call in
flight (so no frame in either ring): a worker that served one big burst
keeps no memory for it, whatever the other workers do. A worker's rings go
when it does.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from workers import rings

log = logging.getLogger("mesh.rings")

QUIET_SECONDS = 1.0


class FrontRings:
    """Every worker's rings, as the front's channel uses them.

    The channel passes a message through outgoing() when it is for one of
    `owed`, the workers whose frames we took and have not said so yet, or
    when one of its payloads reaches `threshold` bytes; and every message
    with a ring field through incoming().
    """

    def __init__(self, ring_bytes: int, is_busy: Callable[[bytes], bool]):
        """ring_bytes: of each direction, 0 for none; is_busy(peer): some call of its is unanswered."""
        self.ring_bytes = ring_bytes
        self._is_busy = is_busy
        self.owed: set[bytes] = set()
        self.threshold = rings.RING_MIN_BYTES if ring_bytes > 0 else math.inf
        self._pairs: dict[bytes, rings.RingPair] = {}  # workers that mapped their rings
        self._offers: dict[bytes, tuple[rings.RingPair, int]] = {}  # pair and memfd, until the worker answers
        self._refused: set[bytes] = set()
        self._frames: dict[bytes, list[int]] = {}  # frames that crossed each worker's rings: [to it, from it]
        self._used: dict[bytes, float] = {}  # workers whose rings have pages to give back: last used
        self._give_back_timer: asyncio.TimerHandle | None = None
        self._can_give_back = True  # until the kernel refuses MADV_REMOVE

    def outgoing(self, peer: bytes, payloads: Sequence[Any]) -> tuple[Sequence[Any], dict | None]:
        """The payloads to send to `peer` and the header's ring field (None: nothing to say)."""
        pair = self._pairs.get(peer)
        if pair is None:
            offer = self._offer(peer)  # the frame itself goes over the socket this once
            return payloads, None if offer is None else {"offer": offer}
        said: dict[str, Any] = {}
        if peer in self.owed:
            self.owed.discard(peer)
            said["taken"] = pair.to_front.taken
        payloads, in_ring = rings.put_in(pair.to_worker, payloads)
        if in_ring:
            said["frames"] = in_ring
            self._frames[peer][0] += len(in_ring)
            self._note_used(peer)
        return payloads, said or None

    def _offer(self, peer: bytes) -> list | None:
        """[memfd path, bytes per ring] of new rings for `peer`; None if it has some coming or refused."""
        if not self.ring_bytes or peer in self._offers or peer in self._refused:
            return None
        try:
            pair, fd = rings.RingPair.create(self.ring_bytes)
        except OSError as error:  # out of file descriptors or memory maps: the socket still works
            log.warning("worker %r keeps its payloads to the socket: no ring (%s)", peer, error)
            self._refused.add(peer)
            return None
        self._offers[peer] = (pair, fd)
        return [f"/proc/{os.getpid()}/fd/{fd}", self.ring_bytes]

    def incoming(self, peer: bytes, field: Any, payloads: list) -> list:
        """The payloads of a message from `peer`, with the frames in its ring copied out."""
        field = rings.checked(field)
        if "accepted" in field or "refused" in field:
            self._answered(peer, _refusal(field))
        pair = self._pairs.get(peer)
        sending, receiving = (pair.to_worker, pair.to_front) if pair else (None, None)
        payloads = rings.apply(field, sending, receiving, payloads)
        if pair is not None and field.get("frames"):
            self.owed.add(peer)
            self._frames[peer][1] += len(field["frames"])
            self._note_used(peer)
        return payloads

    def _answered(self, peer: bytes, refusal: str | None) -> None:
        offer = self._offers.pop(peer, None)
        if offer is None:
            raise rings.RingError("an answer to no offer of rings")
        pair, fd = offer
        os.close(fd)  # mapped by both now, or by us alone
        if refusal is None:
            self._pairs[peer] = pair
            self._frames[peer] = [0, 0]
            return
        pair.close()
        self._refused.add(peer)
        log.warning("worker %r keeps its payloads to the socket: %s", peer, refusal)

    def frames(self, peer: bytes) -> list[int] | None:
        """[frames sent to it, frames received from it] through the worker's rings; None without rings."""
        crossed = self._frames.get(peer)
        return None if crossed is None else list(crossed)

    def forget(self, peer: bytes) -> None:
        """The worker is gone: its rings go, and their memory with them."""
        pair = self._pairs.pop(peer, None)
        offer = self._offers.pop(peer, None)  # a peer has rings or an offer, never both
        if offer is not None:
            pair, fd = offer
            os.close(fd)
        if pair is not None:
            pair.close()
        self._refused.discard(peer)
        self.owed.discard(peer)
        self._used.pop(peer, None)
        self._frames.pop(peer, None)

    def close(self) -> None:
        if self._give_back_timer is not None:
            self._give_back_timer.cancel()
        for peer in [*self._pairs, *self._offers]:
            self.forget(peer)

    def _note_used(self, peer: bytes) -> None:
        if not self._can_give_back:
            return
        self._used[peer] = time.monotonic()
        if self._give_back_timer is None:
            self._give_back_timer = asyncio.get_running_loop().call_later(QUIET_SECONDS, self._give_back)

    def _give_back(self) -> None:
        """Frees the pages of each used ring whose big frames are quiet and whose worker holds no call."""
        self._give_back_timer = None
        now = time.monotonic()
        for peer, last_used in list(self._used.items()):
            if now - last_used < QUIET_SECONDS or self._is_busy(peer):
                continue
            del self._used[peer]
            try:
                self._pairs[peer].give_back()
            except OSError as error:  # a kernel or sandbox without MADV_REMOVE
                log.warning("ring pages stay until their worker exits: cannot give them back (%s)", error)
                self._can_give_back = False
                self._used.clear()
                return
        if self._used:  # look again when the next one goes quiet, or a period on (busy ones)
            quiet_in = [
                QUIET_SECONDS - (now - used) for used in self._used.values() if now - used < QUIET_SECONDS
            ]
            wait = min(quiet_in, default=QUIET_SECONDS)
            self._give_back_timer = asyncio.get_running_loop().call_later(wait, self._give_back)


def _refusal(answer: dict) -> str | None:
    """Why a worker did not map the rings offered; None when it says it did, and nothing else."""
    if "refused" in answer:
        return str(answer["refused"])
    if answer["accepted"] is not True:
        return f"an unclear answer to the offer: {answer!r}"
    return None
