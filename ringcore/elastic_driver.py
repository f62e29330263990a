"""``ringcore-run --min-np/--max-np/--host-discovery-script``: the driver of an elastic job.

Theory of operation. The driver serves the job's store and starts
*workers* (numbered 0, 1, ... for the whole job; their output is prefixed
with that number), which are never told a rank up front: each checks in at
the store and waits (:mod:`ringcore.elastic_protocol` has the keys).
The driver answers with a *generation*: the members in rank order, each
told its rank and the size. Survivors keep their order, so rank 0 is the
oldest survivor, whose last commit every member then takes
(``State.sync``); workers that join are appended.

A generation ends when

- a member exits (non-zero, a signal) or checks in again (it saw a peer
  fail or stall: ``PeerFailure``, ``CollectiveTimeout``): the generation is
  *broken*, and members still meeting stop waiting for it;
- workers are waiting to join (new slots from the discovery script), or a
  host lost slots that members use: the members leave together at their
  next commit (rank 0 reads ``elastic/ended`` and tells the others).

The next generation forms once every live member of the last one has
checked in (or, before the first one or when none is left, every live
newcomer); newcomers that are waiting by then join it. Bounds, all
``--elastic-timeout`` (default 60 s):

- a member that has not checked in that long after the first one did is
  stopped (a stalled process, a rank that hangs), and the world forms without it;
- a new worker that has not checked in that long after its start is stopped
  (a script that does not use ``ringcore.elastic``, a host that cannot start it);
- with fewer live workers than ``--min-np``, the job fails at once when
  nothing can add workers (no discovery script), else after that long,
  naming the first failure: never a deadlock.

Where workers go (the hosts' slots, the discovery script, cooldowns after
a failure) is :mod:`ringcore.elastic_seats`. The driver starts, watches and
stops workers through a :class:`~ringcore.elastic_workers.Pool`: ``ringcore-run``'s
processes or ``ringcore.ray``'s actors (:mod:`ringcore.elastic_workers`).

The job succeeds (exit 0) when every member of the last generation exits
0; a worker that exits 0 ends the job's growth (workers still waiting to
join are stopped). Otherwise the driver exits with the first failing
worker's code, as the fixed launcher does with the first failing rank's.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable, Mapping, Sequence

from ringcore import discovery, hosts
from ringcore.config import Settings
from ringcore.elastic_protocol import BROKEN, ENDED, WORKER_VARIABLE, answer_key, ready_key
from ringcore.elastic_seats import Discoverer, excess, plan_seats
from ringcore.elastic_workers import ElasticOptions, Failure, Messages, Pool, StartWorker, Worker
from ringcore.processes import POLL_SECONDS, LaunchError, SignalCatcher, stopped_suffix
from ringcore.store import StoreClient, StoreServer, tls_contexts

EXIT_TIMEOUT = 124
MAX_COOLDOWN = 3600.0


# How messages name the bounds (ringcore-run's flags; ringcore.ray names its arguments), and what to
# ask about a worker that never checked in.
FLAGS = {
    "min_np": "--min-np",
    "elastic_timeout": "--elastic-timeout",
    "timeout": "--timeout",
    "no_check_in": "does the script use ringcore.elastic (imported before ringcore.init())?",
}


def serve_store(addr: str, port: int, key: bytes, settings: Settings) -> tuple[StoreServer, StoreClient]:
    """The store the workers check in at, on ``addr:port``, and the driver's own connection to it.

    Raises:
        OSError: The address cannot be bound.
        RingcoreError: The driver cannot connect to it (TLS settings).
    """
    server_tls, client_tls = tls_contexts(settings.tls_cert, settings.tls_key, settings.tls_ca)
    server = StoreServer(addr, port, key, settings.handshake_timeout, server_tls)
    try:
        client = StoreClient(
            addr, server.port, settings.init_timeout, key, settings.handshake_timeout, client_tls
        )
    except BaseException:
        server.close()
        raise
    return server, client


class Driver:
    """Runs an elastic job to its end; see the module docstring.

    Args:
        job: Where the workers' processes go (:class:`Pool`).
        options: The elastic options.
        size: Workers to start with; 0: as many as the first listing has slots (up to ``--max-np``).
        fixed: The hosts when there is no discovery script.
        start: Starts a worker (:data:`StartWorker`).
        store: The store for the workers, already serving; the driver closes it.
        client: A connection to it.
        grace: Seconds between SIGTERM and SIGKILL when stopping workers.
        timeout: ``--timeout``: the job's wall-clock limit in seconds; 0: none.
        room: How many more workers can start now (a Ray cluster's free resources), within the hosts'
            slots and ``max_np``; given, lost workers are replaced as with a discovery script.
        flags: How messages name the bounds (:data:`FLAGS`' keys), when not ``ringcore-run``'s flags.
    """

    def __init__(
        self,
        job: Pool,
        options: ElasticOptions,
        size: int,
        fixed: Sequence[hosts.Host],
        start: StartWorker,
        store: StoreServer,
        client: StoreClient,
        grace: float,
        timeout: float,
        *,
        room: Callable[[], int] | None = None,
        flags: Mapping[str, str] | None = None,
    ) -> None:
        self.job, self.options, self.size, self.start = job, options, size, start
        self.store, self.client, self.grace, self.timeout = store, client, grace, timeout
        self.deadline = time.monotonic() + timeout if timeout > 0 else None
        self.listing: list[hosts.Host] = list(fixed)
        self.workers: dict[int, Worker] = {}
        self.members: list[int] = []  # the last generation's, in rank order
        self.generation = 0
        self.ended = 0  # the newest generation that ended (0: none yet)
        self.broken = 0  # the newest generation a member left without being told to
        self.failures: list[Failure] = []  # since the last generation formed
        self.finishing = False  # a member exited 0: no more growth
        self.rendezvous_since: float | None = None  # a member checked in for the next generation
        self.below_since: float | None = None
        self.cooling: dict[str, tuple[float, int]] = {}  # host -> (until, failures there)
        self._local: dict[str, bool] = {}
        self._discoverer = Discoverer(options.discovery) if options.discovery else None
        self._room = room
        self.flags = {**FLAGS, **(flags or {})}

    @property
    def sink(self) -> Messages:
        return self.job.sink

    @property
    def dynamic(self) -> bool:
        """Whether workers can be added during the job (a discovery script, or a pool with room)."""
        return self._discoverer is not None or self._room is not None

    def run(self, catcher: SignalCatcher) -> int:
        """Start the workers and drive the job until it ends; return the launcher's exit code."""
        try:
            self._start_workers()
            while True:
                code = self._step(catcher)
                if code is not None:
                    return code
        except LaunchError as err:
            return self._abort(str(err), err.code)
        finally:
            if self._discoverer is not None:
                self._discoverer.stop()
            self.client.close()
            self.store.close()

    # ------------------------------------------------------------------ one step

    def _step(self, catcher: SignalCatcher) -> int | None:
        for number, returncode in self.job.collect(POLL_SECONDS):
            self._exited(number, returncode)
        now = time.monotonic()
        if catcher.signum is not None:
            return self._abort(f"received {signal.Signals(catcher.signum).name}", 128 + catcher.signum)
        if self.deadline is not None and now >= self.deadline:
            return self._abort(f"job exceeded {self.flags['timeout']} {self.timeout:g}s", EXIT_TIMEOUT)
        if not self.job.running():
            code = self._finished()
            if code is not None:
                return code
        self._take_listing()
        self._read_check_ins(now)
        self._enforce_bounds(now)
        code = self._check_min_np(now)
        if code is not None:
            return code
        self._grow(now)
        self._form()
        return None

    def _live(self) -> list[int]:
        """Workers running that the driver is not stopping."""
        return [n for n in self.job.running() if self.workers[n].kill_at is None]

    def _exited(self, number: int, returncode: int) -> None:
        worker = self.workers[number]
        if worker.kill_at is not None:
            return  # the driver stopped it and said why
        member = number in self.members
        if returncode == 0:
            if member and not self.finishing:
                self.finishing = True
                self._stop_newcomers("the job finished")
            return
        how, code = self.job.describe(number, returncode)
        if member:
            how += f" (rank {self.members.index(number)} of generation {self.generation})"
        self._failed(number, how, code)
        if member:
            self._end_generation(broken=True)

    def _failed(self, number: int, how: str, code: int) -> None:
        self.failures.append(Failure(number, how, code))
        self.sink.message(how)
        host = self.workers[number].seat.host
        _, count = self.cooling.get(host, (0.0, 0))
        pause = min(self.options.cooldown * 2**count, MAX_COOLDOWN)
        self.cooling[host] = (time.monotonic() + pause, count + 1)

    def _end_generation(self, broken: bool) -> None:
        """Members leave the current generation at their next commit; ``broken``: a member is gone already."""
        if broken and self.broken < self.generation:
            self.broken = self.generation
            self.client.set(BROKEN, self.generation)
        if self.ended < self.generation:
            self.ended = self.generation
            self.client.set(ENDED, self.generation)

    def _read_check_ins(self, now: float) -> None:
        live = self._live()
        for number, value in zip(live, self.client.mget([ready_key(n) for n in live]), strict=True):
            worker = self.workers[number]
            if value is None or int(value[0]) <= worker.ready:
                continue
            worker.ready = int(value[0])
            if number in self.members:  # it left its generation: a peer failed or stalled, or it was told
                self._end_generation(broken=True)
                self.rendezvous_since = self.rendezvous_since or now

    def _enforce_bounds(self, now: float) -> None:
        bound = self.options.timeout
        for number in self._live():
            worker = self.workers[number]
            if worker.waiting:
                continue
            if not worker.joined and now - worker.started > bound:
                self._stop(
                    number,
                    f"worker {number} did not check in within {bound:g} s ({self.flags['elastic_timeout']}) of its "
                    f"start; {self.flags['no_check_in']}",
                )
            elif number in self.members and self.rendezvous_since and now - self.rendezvous_since > bound:
                self._stop(
                    number,
                    f"worker {number} (rank {self.members.index(number)}) did not come back to the "
                    f"rendezvous within {bound:g} s ({self.flags['elastic_timeout']}) after generation "
                    f"{self.generation} ended",
                )
        stopping = [n for n in self.job.running() if (self.workers[n].kill_at or now) < now]
        self.job.send(stopping, signal.SIGKILL)

    def _stop(self, number: int, why: str, failed: bool = True) -> None:
        self.job.send([number], signal.SIGTERM)
        self.workers[number].kill_at = time.monotonic() + self.grace
        if failed:
            self._failed(number, why + "; stopped it", 1)
        else:
            self.sink.message(why + "; stopped it")
        if number in self.members:
            self._end_generation(broken=True)

    def _stop_newcomers(self, why: str) -> None:
        for number in self._live():
            if not self.workers[number].joined:
                self._stop(number, f"worker {number} was waiting to join, but {why}", failed=False)

    # ------------------------------------------------------------------ world size

    def _check_min_np(self, now: float) -> int | None:
        needed = self.ended >= self.generation  # a generation must form (also before the first)
        eligible = set(self._live()) - self._excess()
        if not needed or len(eligible) >= self.options.min_np:
            self.below_since = None
            return None
        if not self.dynamic or self.finishing:
            return self._below_min_np(len(eligible), None)
        self.below_since = self.below_since or now
        if now - self.below_since >= self.options.timeout:
            return self._below_min_np(len(eligible), self.options.timeout)
        return None

    def _below_min_np(self, left: int, waited: float | None) -> int:
        reason = f"{left} worker{'' if left == 1 else 's'} left, fewer than {self.flags['min_np']} {self.options.min_np}"
        if waited is not None:
            reason += f", for {waited:g} s ({self.flags['elastic_timeout']})"
        first = self.failures[0] if self.failures else None
        if first is not None:
            reason += f"; the first failure: {first.how}"
        return self._abort(reason, first.code if first is not None else 1)

    def _abort(self, reason: str, code: int) -> int:
        stopped = self.job.stop(self.grace)
        self.sink.message(reason + stopped_suffix(stopped, "workers"))
        return code

    def _finished(self) -> int | None:
        """Every process is gone: the exit code, or ``None`` to wait for the discovery script."""
        if self.members and all(self.job.exits.get(n) == 0 for n in self.members):
            return 0
        if self.dynamic and not self.finishing:
            return None
        first = self.failures[0] if self.failures else None
        if first is None:
            self.sink.message("every worker exited before a generation formed")
            return 1
        self.sink.message(f"generation {self.generation} did not finish: {first.how}")
        return first.code

    # ------------------------------------------------------------------ growing and forming

    def _start_workers(self) -> None:
        if self._discoverer is not None:
            try:
                self.listing = discovery.discover(str(self.options.discovery))
            except discovery.DiscoveryError as err:
                raise LaunchError(f"--host-discovery-script: {err}", 1) from None
            self._discoverer.start()
        cap = self.options.max_np if self.options.max_np is not None else sum(h.slots for h in self.listing)
        for seat in plan_seats(self.listing, {}, set(), self.size or cap):
            self._spawn(*seat)

    def _spawn(self, host: str, slot: int, host_slots: int) -> None:
        number = len(self.workers)
        if host not in self._local:
            self._local[host] = hosts.is_local(hosts.address_name(host))
        if not self._local[host] and hosts.is_loopback(self.store.host):
            self.sink.message(
                f"no worker on {host}: the job's store listens on {self.store.host}, which {host} cannot "
                "reach; give --addr an address of this machine that the hosts reach"
            )
            self.cooling[host] = (time.monotonic() + MAX_COOLDOWN, 1)
            return
        seat = hosts.Slot(number, host, slot, host_slots, self._local[host])
        self.workers[number] = Worker(seat, time.monotonic())
        started = self.start(seat, {WORKER_VARIABLE: str(number)})
        if started != number:
            raise RuntimeError(f"worker {number} was started as process {started}")

    def _take_listing(self) -> None:
        if self._discoverer is None:
            return
        listing, error = self._discoverer.take()
        if error is not None:
            self.sink.message(f"--host-discovery-script: {error}; keeping the last list")
        if listing is not None:
            self.listing = listing

    def _excess(self) -> set[int]:
        if self._discoverer is None:
            return set()
        return excess({n: self.workers[n].seat for n in self._live()}, self.listing)

    def _grow(self, now: float) -> None:
        if not self.dynamic or self.finishing:
            return
        running = self.job.running()  # workers being stopped still hold their slots
        taken: dict[str, set[int]] = {}
        for number in running:
            taken.setdefault(self.workers[number].seat.host, set()).add(self.workers[number].seat.local_rank)
        cooling = {host for host, (until, _) in self.cooling.items() if until > now}
        limit = self.options.max_np if self.options.max_np is not None else sum(h.slots for h in self.listing)
        free = limit - len(running)
        if free > 0 and self._room is not None:
            free = min(free, self._room())
        for seat in plan_seats(self.listing, taken, cooling, free):
            self._spawn(*seat)
        live = self._live()
        newcomers = any(self.workers[n].waiting and not self.workers[n].joined for n in live)
        room = sum(n in live for n in self.members) < (self.options.max_np or limit + 1)
        if self.generation and ((newcomers and room) or self._excess()):
            self._end_generation(broken=False)  # the members leave at their next commit

    def _form(self) -> None:
        if self.ended < self.generation:
            return  # the current generation goes on
        live = self._live()
        members = [n for n in self.members if n in live]
        expected = members or [n for n in live if not self.workers[n].joined]
        if not expected or not all(self.workers[n].waiting for n in expected):
            return
        left_out = self._excess()
        newcomers = [n for n in live if not self.workers[n].joined and self.workers[n].waiting]
        chosen = [n for n in members + newcomers if n not in left_out][: self.options.max_np]
        if len(chosen) < self.options.min_np:
            return  # _check_min_np waits for more, or fails
        self._publish(chosen)
        for number in sorted(left_out & set(live)):
            self._stop(number, f"worker {number}'s slot on {self.workers[number].seat.host} is gone", False)

    def _publish(self, chosen: list[int]) -> None:
        self.generation += 1
        for rank, number in enumerate(chosen):
            worker = self.workers[number]
            self.client.set(answer_key(number, worker.ready), [self.generation, rank, len(chosen)])
            worker.answered, worker.joined = worker.ready, True
        self.members = chosen
        self.failures.clear()
        self.rendezvous_since = self.below_since = None
        listed = ", ".join(map(str, chosen))
        self.sink.message(f"generation {self.generation}: {len(chosen)} ranks (workers {listed})")
