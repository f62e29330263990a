"""``ringcore-run --aslr``: which ranks start without address-space randomization, and how the
launcher sets that for a child alone (:mod:`ringcore.rank_agent`, :mod:`ringcore.processes`)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from ringcore import processes
from ringcore.rank_agent import ADDR_NO_RANDOMIZE, fixed_layout, set_layout
from tests.layout_support import skip_unless_layout_settable


def thread_persona() -> int:
    return int(Path("/proc/thread-self/personality").read_text(), 16)


def in_thread(body: Callable[[], None]) -> None:
    """Run ``body`` in a fresh thread (a persona is per thread) and re-raise what it raised."""
    failed: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as err:  # handed to the test's thread
            failed.append(err)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(30)
    if failed:
        raise failed[0]


def test_auto_fixes_the_layout_only_where_ranks_outnumber_the_cpus(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    assert fixed_layout("auto", 3) is True and fixed_layout("auto", 2) is None
    assert fixed_layout("off", 1) is True
    assert fixed_layout("on", 9) is False


def test_set_layout_sets_and_clears_the_flag_for_the_calling_thread_alone() -> None:
    skip_unless_layout_settable()
    mine = thread_persona()

    def body() -> None:
        start = thread_persona()
        before = set_layout(True)
        assert thread_persona() == start | ADDR_NO_RANDOMIZE
        assert before == (None if start & ADDR_NO_RANDOMIZE else start)
        assert set_layout(True) is None  # already so: nothing to restore
        set_layout(False)  # --aslr on: randomized even under a launcher that is not
        assert thread_persona() == start & ~ADDR_NO_RANDOMIZE
        assert set_layout(None) is None and thread_persona() == start & ~ADDR_NO_RANDOMIZE

    in_thread(body)
    assert thread_persona() == mine, "another thread's persona stays as it was"


def test_laid_out_holds_the_layout_for_the_block_and_restores_the_thread() -> None:
    skip_unless_layout_settable()

    def body() -> None:
        start = thread_persona()
        with processes._laid_out(not start & ADDR_NO_RANDOMIZE, pytest.fail):
            assert thread_persona() == start ^ ADDR_NO_RANDOMIZE
        assert thread_persona() == start

    in_thread(body)


def test_laid_out_says_a_refusal_and_runs_the_block_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(fixed: bool | None) -> int | None:
        raise PermissionError(1, "personality(2) refused")

    monkeypatch.setattr(processes, "set_layout", refuse)
    said: list[OSError] = []
    ran = False
    with processes._laid_out(True, said.append):
        ran = True
    assert ran and len(said) == 1 and said[0].errno == 1
