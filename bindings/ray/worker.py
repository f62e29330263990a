"""The Ray actor behind each rank of a :class:`~ringcore.ray.RingcoreExecutor`.

An actor is one process that lives as long as the executor: it holds the
user's state between calls (an instance of ``executable_cls``, or an empty
namespace), gets its ``RINGCORE_*`` variables once Ray has placed every
worker, and runs the functions the driver sends. It never calls
``ringcore.init()`` itself: the user's function does, as under any launcher.

Failing alone. When a function raises, the actor closes this rank's ringcore
communicator before passing the error on (and a torch.distributed group on
the "ringcore" backend), so the other ranks' collectives fail at once with
``PeerFailure`` instead of waiting out ``RINGCORE_TIMEOUT``, and every
surviving actor is back to "not initialized", ready for the next ``run``.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ray

import ringcore

log = logging.getLogger("ringcore")


class RingcoreWorker:
    """One rank: its state, its environment, and the calls it runs."""

    def __init__(self) -> None:
        self.state: Any = types.SimpleNamespace()

    def describe(self) -> tuple[str, str, int]:
        """``(node_id, node_ip, pid)`` of this actor."""
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def free_port(self, host: str) -> int:
        """A port free on ``host`` now, for rank 0's store (the kernel picks it)."""
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
            sock.bind((host, 0))
            return sock.getsockname()[1]

    def setup(
        self,
        env: Mapping[str, str],
        executable_cls: type | None = None,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        """Export ``env`` (this rank's ``RINGCORE_*``), then make the state ``execute`` passes around."""
        os.environ.update(env)
        if executable_cls is not None:
            self.state = executable_cls(*args, **(kwargs or {}))

    def run(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """``fn(*args, **kwargs)``; on an error, leave the job first (see the module docstring)."""
        return self._guarded(fn, *args, **kwargs)

    def execute(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(state)``; on an error, leave the job first."""
        return self._guarded(fn, self.state)

    def reset(self) -> None:
        """Close this rank's ringcore communicator and a "ringcore" torch.distributed group, if open."""
        try:
            ringcore.shutdown()
        except Exception as err:  # closing a broken communicator must not hide the user's error
            log.warning("ringcore.ray: ringcore.shutdown() failed while resetting: %r", err)
        dist = sys.modules.get("torch.distributed")
        if dist is None or not dist.is_available() or not dist.is_initialized():
            return
        try:
            if dist.get_backend() == "ringcore":
                dist.destroy_process_group()
        except Exception as err:
            log.warning("ringcore.ray: destroying the ringcore process group failed: %r", err)

    def _guarded(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except BaseException:
            self.reset()
            raise


class ElasticWorker(RingcoreWorker):
    """One worker of an :class:`~ringcore.ray.ElasticRingcoreExecutor`: runs the user's function once.

    Its process starts with ``RINGCORE_ELASTIC_WORKER`` and the driver's store in
    its environment, so ``ringcore.init()`` joins the driver's generations. After
    the function, returned or raised, the actor leaves the job as an exiting
    process would (rank 0 waits there for its peers to leave its store).
    """

    def run(self, fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]) -> Any:
        """``fn(*args, **kwargs)`` with ``ringcore.elastic`` imported first, then ``ringcore.shutdown()``."""
        import ringcore.elastic  # noqa: F401  # init() joins generations even if fn imports it only later

        try:
            return fn(*args, **kwargs)
        finally:
            self.reset()
