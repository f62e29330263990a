"""The executors' one wait loop (:mod:`ringcore.algo.waiting`)."""

from __future__ import annotations

import time

import pytest

from ringcore.algo.waiting import Watch
from ringcore.errors import CollectiveTimeout
from ringcore.transport.base import PeerAborted


class _Quiet:
    """A transport where nothing moves until ``abort`` is set, then a peer's ABORT arrives."""

    abort: PeerAborted | None = None

    def progress(self, timeout: float) -> bool:
        if self.abort is not None:
            raise self.abort
        return False


def test_a_peers_abort_carries_what_this_rank_waited_for_and_how_long() -> None:
    transport = _Quiet()
    watch = Watch(transport, 5.0, None, lambda: "waiting for receive from rank 1 (collective #2 step 1)")  # type: ignore[arg-type]
    watch.last_moved -= 2.5
    transport.abort = PeerAborted(
        0, {"kind": "timeout", "message": "no progress for 3 s: waiting for rank 2"}
    )
    with pytest.raises(PeerAborted) as caught:
        watch.progress(0.0)
    waiting = caught.value.waiting
    assert waiting.startswith("waiting for receive from rank 1 (collective #2 step 1) for 2.")
    assert waiting.endswith(" s")


def test_nothing_moving_for_the_timeout_names_what_the_run_waits_for() -> None:
    watch = Watch(_Quiet(), 0.05, None, lambda: "waiting for send to rank 3")  # type: ignore[arg-type]
    time.sleep(0.06)
    with pytest.raises(CollectiveTimeout, match=r"no progress for 0\.05 s: waiting for send to rank 3"):
        watch.progress(0.0)
