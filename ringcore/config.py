"""Every ``RINGCORE_*`` environment variable, parsed once into a frozen dataclass.

This is the only module that reads ``RINGCORE_*`` variables. Launcher
conventions of torchrun, OpenMPI and Slurm are read in
:mod:`ringcore.rendezvous` (discovery), never here.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping

from ringcore.errors import ConfigError
from ringcore.rank_agent import ASLR_CHOICES

KIB = 1024
MIB = 1024 * KIB

_SUFFIXES = {"": 1, "K": KIB, "M": MIB, "G": 1024 * MIB}


def parse_size(text: str, name: str = "size") -> int:
    """Parse ``"512K"``, ``"4M"``, ``"1G"`` or a plain byte count."""
    raw = text.strip().upper().removesuffix("B").removesuffix("I")
    suffix = raw[-1:] if raw[-1:] in "KMG" and raw[-1:] else ""
    number = raw[: len(raw) - len(suffix)]
    try:
        value = int(float(number) * _SUFFIXES[suffix])
    except (ValueError, OverflowError):
        raise ConfigError(f"{name}={text!r} is not a size; use e.g. 4096, 512K, 4M or 1G") from None
    if value < 0:
        raise ConfigError(f"{name}={text!r} must not be negative")
    return value


@dataclasses.dataclass(frozen=True)
class Settings:
    """Tunables and launcher-provided identity, from ``RINGCORE_*`` variables.

    Identity fields are ``None`` when the variable is unset, so discovery can
    fall back to other launchers' conventions.
    """

    rank: int | None = None
    size: int | None = None
    local_rank: int | None = None
    local_size: int | None = None
    addr: str | None = None
    port: int | None = None
    ifname: str | None = None
    timeout: float = 300.0
    init_timeout: float = 120.0
    channels: int = 1
    segment_bytes: int | None = None  # None: auto (see segment_size)
    small_bytes: int = 64 * KIB
    halving_bytes: int = 4 * MIB  # halving-doubling up to this on 4+ ranks; 0: never
    slice_bytes: int | None = None  # None: auto (see allreduce_slice_bytes)
    hierarchical: bool = True  # allreduce inside hosts, then across them, on jobs of several multi-rank hosts
    socket_buffer: int = 4 * MIB  # SO_SNDBUF/SO_RCVBUF; 0 leaves them to the kernel's autotuning (see README)
    atomic: bool = False  # a failed in-place allreduce restores the caller's buffer (one extra copy)
    # allreduces of this size and more on one host, where every rank may copy to and from every other
    # (process_vm_readv/writev), go direct: each rank reduces its share from the peers' buffers and
    # writes it into theirs (ringcore.plans.direct); below it only arrays from ringcore.empty do, and
    # other buffers take the mailboxes' one or two shots (ringcore.plans.oneshot);
    # None: auto (see direct_from); 0: none (the ring, and no one- or two-shot route either)
    direct_bytes: int | None = None
    # auto | fast | slow: the kernel's copies (process_vm_readv) next to memmove on this host, which
    # moves direct_from's auto limits; auto: measured at set-up and agreed (see direct_from)
    kernel_copies: str = "auto"
    spin_us: int | None = None  # busy-poll before sleeping; None: auto (see spin_seconds)
    # one-shot allreduces (ringcore.plans.oneshot, "One reducer"): one rank reduces each for all (True)
    # or every rank reduces (False); None: auto, one where the host's ranks outnumber its CPUs
    one_reducer: bool | None = None
    log_level: str = "WARNING"
    secret: bytes | None = None
    handshake_timeout: float = 10.0
    port_range: tuple[int, int] | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    timeline: str | None = None
    stall_warning: float = 60.0
    stall_shutdown: float | None = None
    gpu_staging_bytes: int = 8 * MIB  # pinned host memory per connection and direction (GPU buffers)
    # tcp | shm | ibverbs | auto. auto: RDMA when every rank can; else shared memory between the
    # ranks on one host (x86-64, room in /dev/shm; otherwise TCP, with one warning) and TCP between hosts.
    transport: str = "auto"
    shm_bytes: int = 4 * MIB  # RINGCORE_TRANSPORT=shm or auto: shared memory per ordered pair of local ranks
    # frames from this size to a local peer go as a pointer it copies with one process_vm_readv; 0: never.
    # 1 MiB: below it (data in cache) the two slot copies were faster (bench/HISTORY.md, "one copy for large frames")
    shm_single_copy_bytes: int = 1 * MIB
    # ...but only in collectives whose buffers on the host (bytes x local ranks) exceed this; None: auto,
    # the last-level cache (bench/HISTORY.md, "Pointers only past the cache"); 0: in every collective
    shm_cache_bytes: int | None = None
    ib_device: str | None = None
    ib_port: int = 1
    ib_gid_index: int | None = None
    fusion_threshold: int = 8 * MIB  # ringcore.torch: bytes of small gradients packed into one allreduce
    plan_cache_bytes: int = 32 * MIB  # scratch kept allreduce plans may hold for themselves, in all
    elastic_worker: int | None = None  # set by an elastic ringcore-run: this worker's number

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Settings:
        """Read every ``RINGCORE_*`` variable from ``env`` (default: ``os.environ``)."""
        env = os.environ if env is None else env
        reader = _Reader(env)
        return cls(
            rank=reader.int("RINGCORE_RANK", None, minimum=0),
            size=reader.int("RINGCORE_SIZE", None, minimum=1),
            local_rank=reader.int("RINGCORE_LOCAL_RANK", None, minimum=0),
            local_size=reader.int("RINGCORE_LOCAL_SIZE", None, minimum=1),
            addr=env.get("RINGCORE_ADDR") or None,
            port=reader.int("RINGCORE_PORT", None, minimum=1, maximum=65535),
            ifname=env.get("RINGCORE_IFNAME") or None,
            timeout=reader.float("RINGCORE_TIMEOUT", cls.timeout),
            init_timeout=reader.float("RINGCORE_INIT_TIMEOUT", cls.init_timeout),
            channels=reader.int("RINGCORE_CHANNELS", cls.channels, minimum=1, maximum=64),
            segment_bytes=reader.size_or_auto("RINGCORE_SEGMENT_BYTES", minimum=4 * KIB),
            small_bytes=reader.size("RINGCORE_SMALL_BYTES", cls.small_bytes, minimum=0),
            halving_bytes=reader.size("RINGCORE_HALVING_BYTES", cls.halving_bytes, minimum=0),
            slice_bytes=reader.size_or_auto("RINGCORE_SLICE_BYTES", minimum=64 * KIB),
            hierarchical=reader.flag("RINGCORE_HIERARCHICAL", cls.hierarchical),
            socket_buffer=reader.size("RINGCORE_SOCKET_BUFFER", cls.socket_buffer, minimum=0),
            atomic=reader.flag("RINGCORE_ATOMIC", cls.atomic),
            direct_bytes=reader.size_or_auto("RINGCORE_DIRECT_BYTES", minimum=0),
            kernel_copies=_choice("RINGCORE_KERNEL_COPIES", env.get("RINGCORE_KERNEL_COPIES"), KERNEL_COPIES),
            spin_us=_spin(env.get("RINGCORE_SPIN_US", "auto")),
            one_reducer=reader.flag_or_auto("RINGCORE_ONE_REDUCER"),
            log_level=_choice("RINGCORE_LOG_LEVEL", env.get("RINGCORE_LOG_LEVEL"), LOG_LEVELS).upper(),
            secret=env["RINGCORE_SECRET"].encode() if "RINGCORE_SECRET" in env else None,
            handshake_timeout=reader.float("RINGCORE_HANDSHAKE_TIMEOUT", cls.handshake_timeout),
            port_range=_port_range(env.get("RINGCORE_PORT_RANGE", "")),
            tls_cert=env.get("RINGCORE_TLS_CERT") or None,
            tls_key=env.get("RINGCORE_TLS_KEY") or None,
            tls_ca=env.get("RINGCORE_TLS_CA") or None,
            timeline=env.get("RINGCORE_TIMELINE") or None,
            stall_warning=reader.float("RINGCORE_STALL_WARNING", cls.stall_warning),
            stall_shutdown=reader.float("RINGCORE_STALL_SHUTDOWN", 0.0) or None,
            gpu_staging_bytes=reader.size(
                "RINGCORE_GPU_STAGING_BYTES", cls.gpu_staging_bytes, minimum=64 * KIB
            ),
            transport=_transport(env.get("RINGCORE_TRANSPORT") or cls.transport),
            shm_bytes=reader.size("RINGCORE_SHM_BYTES", cls.shm_bytes, minimum=64 * KIB),
            shm_single_copy_bytes=reader.size(
                "RINGCORE_SHM_SINGLE_COPY_BYTES", cls.shm_single_copy_bytes, minimum=0
            ),
            shm_cache_bytes=reader.size_or_auto("RINGCORE_SHM_CACHE_BYTES", minimum=0),
            ib_device=env.get("RINGCORE_IB_DEVICE") or None,
            ib_port=reader.int("RINGCORE_IB_PORT", cls.ib_port, minimum=1, maximum=255),
            ib_gid_index=reader.int("RINGCORE_IB_GID_INDEX", None, minimum=0, maximum=4095),
            fusion_threshold=reader.size("RINGCORE_FUSION_THRESHOLD", cls.fusion_threshold, minimum=0),
            plan_cache_bytes=reader.size("RINGCORE_PLAN_CACHE_BYTES", cls.plan_cache_bytes, minimum=0),
            elastic_worker=reader.int("RINGCORE_ELASTIC_WORKER", None, minimum=0),
        )

    def spin_seconds(self) -> float:
        """How long a waiting rank polls its sockets before it sleeps in ``poll``.

        Waking a sleeping peer costs both sides tens of microseconds (on a VM,
        an inter-processor interrupt and a context switch), more than a small
        allreduce's own work. Spinning avoids it; ``auto`` spins 200 us,
        calling ``sched_yield`` between polls (see ``transport.tcp``).
        """
        return (AUTO_SPIN_US if self.spin_us is None else self.spin_us) / 1e6

    def segment_size(self, wide: bool = False, whole_chunk: bool = False) -> int:
        """Bytes per pipelined segment: ``RINGCORE_SEGMENT_BYTES`` when set.

        Auto, for the uncompressed allreduce ring over TCP:
        - ``whole_chunk`` (one host, cache-sized slices, see
          ``allreduce_slice_bytes``): 1 MiB, a rank's whole chunk of a slice,
          so every slice is a one-segment ring, which runs in lockstep
          (``algo.lockstep``) instead of a pipeline of two 512 KiB segments:
          no pipeline bookkeeping per slice, so less user CPU (measured:
          ``bench/HISTORY.md``, "One segment per rank per cache-sized slice").
        - ``wide`` (the rest): 2 MiB. Fewer, larger segments cost less Python
          and fewer wake-ups per byte, and where the link is the limit they
          cost nothing: a segment's time does not stall the pipeline, whose
          links stay busy with earlier segments (measured:
          ``bench/HISTORY.md``, "Loopback after plan reuse and 2 MiB segments
          on crowded hosts").

        Everything else (compressed rings, broadcasts, allgathers...): 512 KiB.
        """
        if self.segment_bytes is not None:
            return self.segment_bytes
        if whole_chunk:
            return CACHE_SLICE_PER_RANK
        return WIDE_SEGMENT_BYTES if wide else SEGMENT_BYTES

    def scratch_slice_bytes(self) -> int:
        """Wire bytes per slice of a broadcast: ``RINGCORE_SLICE_BYTES``, auto 48 MiB (bounds scratch)."""
        return SCRATCH_SLICE_BYTES if self.slice_bytes is None else self.slice_bytes

    def direct_from(self, size: int, slow_copies: bool = False) -> int:
        """Bytes from which an allreduce of ``size`` ranks on one host goes direct: ``RINGCORE_DIRECT_BYTES``
        when set (0: never).

        Auto: 384 KiB for two ranks, 1 MiB for more. Below it the mailboxes'
        routes win (``ringcore.plans.oneshot``: one or two waits and user-space
        copies, against the direct route's vote, closing barrier and a system
        call per piece and peer). Measured (``bench/HISTORY.md``, "Two shots"):
        at N=2 one shot had 1.06x the direct route's busbw at 256 KiB and
        0.85-0.89x at 384 KiB; at N=3 two shots had 1.18x at 512 KiB, at N=4
        1.04-1.06x from 512 to 768 KiB and 0.98x at 896 KiB.

        With ``slow_copies`` (the kernel copies at under ``SLOW_KERNEL_COPIES``
        of ``memmove``'s speed on this host: ``RINGCORE_KERNEL_COPIES``, auto
        measured at set-up, :func:`ringcore.transport.cma.relative_speed`) the
        direct route's system calls cost more than user-space copies through
        shared memory while the buffers stay in cache: 16 MiB for two ranks (the
        ring through the slots between :meth:`mailboxes_below` and it), 8 MiB
        for more (two shots below it, in pieces of a mailbox's slot past 1 MiB).
        Measured on an AMD EPYC VM, 0.22-0.27 (``bench/HISTORY.md``, "Slow
        kernel copies"): at N=2 the ring had 1.30-1.67x the direct route's
        busbw from 384 KiB to 4 MiB, 1.13x at 8 MiB and 0.86x at 16 MiB; at N=4
        two shots 1.66-1.71x at 1 MiB and 1.2-1.7x from 2 to 16 MiB, where the
        ring had 0.70-0.87x, but where the two vCPUs' caches lie far apart
        (spells of that host) two shots fell to 0.4-0.8x from 4 MiB.
        """
        if self.direct_bytes is not None:
            return self.direct_bytes
        if size == 2:
            return AUTO_DIRECT_PAIR_SLOW_BYTES if slow_copies else AUTO_DIRECT_PAIR_BYTES
        return AUTO_DIRECT_SLOW_BYTES if slow_copies else AUTO_DIRECT_BYTES

    def mailboxes_below(self, size: int, slow_copies: bool = False) -> int:
        """Bytes below which an ordinary buffer's allreduce of ``size`` ranks on one host may take the
        mailboxes' one or two shots (``ringcore.plans.oneshot``; one shot within a slot, two in pieces):
        :meth:`direct_from`, but never past 384 KiB for two ranks in auto, where the ring
        through the slots beats one shot (``bench/HISTORY.md``, "Slow kernel copies")."""
        below = self.direct_from(size, slow_copies)
        return min(below, AUTO_DIRECT_PAIR_BYTES) if size == 2 and self.direct_bytes is None else below

    def allreduce_slice_bytes(self, size: int, cache_sized: bool) -> int:
        """Wire bytes per slice of an allreduce: ``RINGCORE_SLICE_BYTES`` when set.

        Auto: 48 MiB, a bound on scratch memory; but with ``cache_sized`` (every
        rank on one host: over TCP with a CPU for each, over shared memory
        crowded too, ``Placement.cache_slices``) ``size`` MiB, so each rank's
        chunk of a slice (one 1 MiB segment, see ``segment_size``) is still in
        cache when the kernel copies it out, when it is reduced and when it is
        sent on: the kernel's copies, most of an allreduce's CPU, then run
        from cache instead of DRAM (measured: ``bench/HISTORY.md``, "Loopback
        after cache-sized slices"). Every slice ends in a wait for the ring's
        last step, cheap only on a host's own loopback.
        """
        if self.slice_bytes is not None:
            return self.slice_bytes
        return min(SCRATCH_SLICE_BYTES, size * CACHE_SLICE_PER_RANK) if cache_sized else SCRATCH_SLICE_BYTES

    def __repr__(self) -> str:  # never print the secret
        fields = ", ".join(
            f"{f.name}={'<set>' if f.name == 'secret' and self.secret is not None else getattr(self, f.name)!r}"
            for f in dataclasses.fields(self)
        )
        return f"Settings({fields})"


def assignments(text: str, launcher: bool = False) -> dict[str, str]:
    """The ``RINGCORE_*`` variables ``NAME=VALUE+NAME=VALUE`` sets (names without the prefix), checked.

    For the tools that compare settings side by side (``bench/compare.py``'s
    ``ringcore:...`` engines, ``bench/ab_settings.py``): a misspelt name would
    otherwise measure the defaults under another label. ``launcher``: ``ringcore-run``'s
    ``BIND_TO`` and ``ASLR`` too, for a tool that starts each variant through it.

    Raises:
        ConfigError: a part is not ``NAME=VALUE``, names no setting, or holds a value it refuses.
    """
    known = {field.name.upper() for field in dataclasses.fields(Settings)}
    choices = LAUNCHER_CHOICES if launcher else {}
    env = {}
    for part in text.split("+"):
        name, sep, value = part.partition("=")
        name = name.strip().upper()
        if not sep or not name:
            raise ConfigError(f"{part!r} in {text!r} is not NAME=VALUE (e.g. SPIN_US=0)")
        if name not in known and name not in choices:
            raise ConfigError(f"{part!r} in {text!r}: there is no setting RINGCORE_{name}")
        if name in choices and value not in choices[name]:
            raise ConfigError(f"RINGCORE_{name}={value!r} is not one of {', '.join(choices[name])}")
        env[f"RINGCORE_{name}"] = value
    Settings.from_env(env)  # each value as init would read it
    return env


AUTO_SPIN_US = 200
SEGMENT_BYTES = 512 * KIB
WIDE_SEGMENT_BYTES = 2 * MIB
SCRATCH_SLICE_BYTES = 48 * MIB
CACHE_SLICE_PER_RANK = 1 * MIB
AUTO_DIRECT_BYTES = 1 * MIB  # the direct route's auto limit (Settings.direct_from)
AUTO_DIRECT_PAIR_BYTES = 384 * KIB  # ... for two ranks
AUTO_DIRECT_SLOW_BYTES = 8 * MIB  # ... where the kernel's copies are slow (two shots in pieces below)
AUTO_DIRECT_PAIR_SLOW_BYTES = 16 * MIB  # ... and for two ranks there (the ring below)
# process_vm_readv's speed over memmove's below which the kernel's copies are slow (0.22-0.27 on an
# AMD host, 0.52-0.53 on an Intel one): Settings.direct_from
SLOW_KERNEL_COPIES = 0.375


def _spin(text: str) -> int | None:
    text = text.strip().lower()
    if text in ("", "auto"):
        return None
    try:
        value = int(text)
    except ValueError:
        raise ConfigError(f"RINGCORE_SPIN_US={text!r} is not a number of microseconds or 'auto'") from None
    return _bounded("RINGCORE_SPIN_US", value, 0, 1_000_000)


class _Reader:
    """Typed access to an environment mapping with errors that name the variable."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def int(self, name: str, default: int | None, minimum: int = 0, maximum: int | None = None) -> int | None:
        text = self.env.get(name, "").strip()
        if not text:
            return default
        try:
            value = int(text)
        except ValueError:
            raise ConfigError(f"{name}={text!r} is not an integer") from None
        return _bounded(name, value, minimum, maximum)

    def float(self, name: str, default: float) -> float:
        text = self.env.get(name, "").strip()
        if not text or (text == "0" and default == 0.0):
            return default
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{name}={text!r} is not a number of seconds") from None
        if not value > 0:
            raise ConfigError(f"{name}={text!r} must be a positive number of seconds")
        return value

    def flag(self, name: str, default: bool) -> bool:
        text = self.env.get(name, "").strip().lower()
        if not text:
            return default
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{name}={text!r} is not a flag; use 1 or 0")

    def flag_or_auto(self, name: str) -> bool | None:
        if self.env.get(name, "").strip().lower() in ("", "auto"):
            return None
        return self.flag(name, False)

    def size_or_auto(self, name: str, minimum: int) -> int | None:
        text = self.env.get(name, "").strip()
        if text.lower() in ("", "auto"):
            return None
        return _bounded(name, parse_size(text, name), minimum, None)

    def size(self, name: str, default: int, minimum: int) -> int:
        text = self.env.get(name, "").strip()
        if not text:
            return default
        return _bounded(name, parse_size(text, name), minimum, None)


TRANSPORTS = ("tcp", "shm", "ibverbs", "auto")
KERNEL_COPIES = ("auto", "fast", "slow")
LOG_LEVELS = ("warning", "debug", "info", "error", "critical", "warn", "fatal", "notset")  # logging's names
# RINGCORE_* variables read outside Settings (README, "Environment variables"): ringcore-run's
# binding and address layout, and ringcore.kernels.casts' switch; RINGCORE_TEST_* belong to the test suite.
OTHER_VARIABLES = frozenset({"RINGCORE_BIND_TO", "RINGCORE_ASLR", "RINGCORE_TORCH_CASTS"})
LAUNCHER_CHOICES = {"BIND_TO": ("core", "none"), "ASLR": ASLR_CHOICES}  # ringcore-run's, for assignments()


def unknown_variables(env: Mapping[str, str] | None = None) -> list[str]:
    """The ``RINGCORE_*`` names in ``env`` (default: ``os.environ``) that no part of ringcore reads,
    each with the known name it most resembles where there is one: ``init()`` warns about them,
    since a misspelt setting would otherwise run silently with its default."""
    env = os.environ if env is None else env
    known = {f"RINGCORE_{field.name.upper()}" for field in dataclasses.fields(Settings)} | OTHER_VARIABLES
    said = []
    for name in sorted(env):
        if not name.startswith("RINGCORE_") or name in known or name.startswith("RINGCORE_TEST_"):
            continue
        close = difflib.get_close_matches(
            name[9:], [known_name[9:] for known_name in known], n=1, cutoff=0.75
        )
        said.append(f"{name} (did you mean RINGCORE_{close[0]}?)" if close else name)
    return said


def _choice(name: str, text: str | None, choices: tuple[str, ...]) -> str:
    """``text`` (default: the first of ``choices``) as one of ``choices``."""
    value = (text or choices[0]).strip().lower()
    if value not in choices:
        raise ConfigError(f"{name}={text!r} is not one of {', '.join(choices)}")
    return value


def _transport(text: str) -> str:
    name = text.strip().lower()
    if name not in TRANSPORTS:
        raise ConfigError(f"RINGCORE_TRANSPORT={text!r} is not one of {', '.join(TRANSPORTS)}")
    return name


def _port_range(text: str) -> tuple[int, int] | None:
    """``"20000-20100"`` -> ``(20000, 20100)``."""
    if not text.strip():
        return None
    try:
        low, high = (int(part) for part in text.split("-"))
    except ValueError:
        raise ConfigError(f"RINGCORE_PORT_RANGE={text!r} is not a range like 20000-20100") from None
    if not 1 <= low <= high <= 65535:
        raise ConfigError(f"RINGCORE_PORT_RANGE={text!r} must satisfy 1 <= low <= high <= 65535")
    return low, high


def _bounded(name: str, value: int, minimum: int, maximum: int | None) -> int:
    if value < minimum or (maximum is not None and value > maximum):
        upper = f" and at most {maximum}" if maximum is not None else ""
        raise ConfigError(f"{name}={value} must be at least {minimum}{upper}")
    return value
