"""The ibverbs transport: pyverbs devices, RC queue pairs, and how ranks connect them.

This is the only module that imports pyverbs; the protocol it carries is
:mod:`ringcore.transport.rdma`. Both rdma-core ABIs are supported: Debian's
``python3-pyverbs`` (rdma-core 44, enums in ``pyverbs.enums``) and PyPI's
``pyverbs`` 59 built with its own rdma-core (``pyverbs.libibverbs_enums``).

Set-up (:func:`open_device`, then :func:`connect`):

1. Pick the device (``RINGCORE_IB_DEVICE``, else the first with an ACTIVE
   port), the port (``RINGCORE_IB_PORT``) and the GID (``RINGCORE_IB_GID_INDEX``,
   else the first RoCE v2 GID that is IPv4-mapped, then any other routable
   one; a link-local GID on a loopback netdev never works).
2. Open a protection domain, one completion queue with a completion channel
   (its file descriptor is what :class:`~ringcore.transport.rdma.RdmaTransport`
   sleeps on), and one RC queue pair per ``(peer, channel)`` link: the same
   links as the TCP mesh.
3. Publish GID, MTU and queue-pair numbers through the rendezvous store, read
   every peer's, take each queue pair INIT -> RTR -> RTS with a global route
   header (RoCE needs one), post the control receives, and meet at a store
   barrier so nobody writes to a queue pair that is not ready.

Memory registration goes through ``MR(pd, length, access, address=...)`` on
the caller's own memory; a CUDA buffer would register through ``DmaBufMR``
behind the same :meth:`VerbsDevice.register`.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
from typing import Any

from ringcore.config import Settings
from ringcore.errors import CollectiveTimeout, ConfigError
from ringcore.transport.rdma import DEPTH, RECEIVED, SENT, WRITTEN, Completion, RdmaTransport
from ringcore.transport.tcp import TcpTransport, needed_links

log = logging.getLogger("ringcore")

try:
    from pyverbs import device as _device
    from pyverbs.addr import GID, AHAttr, GlobalRoute
    from pyverbs.cq import CQ, CompChannel
    from pyverbs.mr import MR
    from pyverbs.pd import PD
    from pyverbs.qp import QP, QPAttr, QPCap, QPInitAttr
    from pyverbs.wr import SGE, RecvWR, SendWR

    try:
        import pyverbs.libibverbs_enums as e  # rdma-core >= 59
    except ImportError:
        import pyverbs.enums as e  # rdma-core 44 (Debian 12)
    _IMPORT_ERROR: str | None = None
except ImportError as err:  # pragma: no cover - depends on the machine
    _IMPORT_ERROR = str(err)

SYSFS = "/sys/class/infiniband"
PORT_ACTIVE = 4
_RECV_FLAG = 1 << 40
_INLINE_BYTES = 64
_EVENT_LINK = "anon_inode:[infinibandevent]"


class VerbsDevice:
    """One rank's verbs objects (implements :class:`ringcore.transport.rdma.Device`)."""

    def __init__(self, settings: Settings, links: list[tuple[int, int]], depth: int = DEPTH) -> None:
        if _IMPORT_ERROR is not None:
            raise ConfigError(
                f"pyverbs is not importable ({_IMPORT_ERROR}): install your distribution's python3-pyverbs "
                "(Debian/Ubuntu: apt-get install python3-pyverbs, then a venv with --system-site-packages) "
                "or set RINGCORE_TRANSPORT=tcp"
            )
        self.name = settings.ib_device or _first_active_device(settings.ib_port)
        self.port = settings.ib_port
        self.links = links
        self.ctx = _open_context(self.name)
        self._objects: list[Any] = []
        try:
            attr = self.ctx.query_port(self.port)
            if attr.state != PORT_ACTIVE:
                raise ConfigError(
                    f"port {self.port} of RDMA device {self.name} is not ACTIVE (state {attr.state})"
                )
            self.mtu = attr.active_mtu
            self.gid_index = (
                settings.ib_gid_index
                if settings.ib_gid_index is not None
                else choose_gid_index(self.name, self.port)
            )
            self.gid = str(self.ctx.query_gid(self.port, self.gid_index))
            if not self.gid.replace(":", "").strip("0"):
                raise ConfigError(
                    f"GID {self.gid_index} of {self.name} port {self.port} is empty; pick another "
                    f"RINGCORE_IB_GID_INDEX (see `ls {SYSFS}/{self.name}/ports/{self.port}/gids`)"
                )
            self.pd = PD(self.ctx)
            self.channel, self.fd = _completion_channel(self.ctx)
            self.cq = CQ(self.ctx, max(64, 4 * depth * len(links)), None, self.channel, 0)
            cap = QPCap(
                max_send_wr=2 * depth,
                max_recv_wr=depth,
                max_send_sge=1,
                max_recv_sge=1,
                max_inline_data=_INLINE_BYTES,
            )
            self.qps = [
                QP(self.pd, QPInitAttr(qp_type=e.IBV_QPT_RC, scq=self.cq, rcq=self.cq, cap=cap))
                for _ in links
            ]
        except BaseException:
            self.ctx.close()
            raise
        self._inline = bytearray(_INLINE_BYTES)
        # Work requests are built once and re-filled: pyverbs objects cost microseconds to create,
        # and ibv_post_send/recv copy the request, so reuse after posting is safe.
        self._control_sge = SGE(_bytearray_address(self._inline), 0, 0)
        self._control_wr = SendWR(
            opcode=e.IBV_WR_SEND,
            num_sge=1,
            sg=[self._control_sge],
            send_flags=e.IBV_SEND_SIGNALED | e.IBV_SEND_INLINE,
        )
        self._write_sge = SGE(0, 0, 0)
        self._write_wr = SendWR(
            opcode=e.IBV_WR_RDMA_WRITE_WITH_IMM,
            num_sge=1,
            sg=[self._write_sge],
            send_flags=e.IBV_SEND_SIGNALED,
        )
        self._recv_wrs: dict[tuple[int, int], Any] = {}  # (link, slot) -> RecvWR: slots never move
        self._statuses = {
            getattr(e, name): name for name in dir(e) if name.startswith("IBV_WC_") and name.endswith("_ERR")
        }
        self._warn_memlock()

    def record(self) -> dict[str, Any]:
        """What peers need to connect to this rank: GID, MTU and queue pair per link."""
        return {
            "device": self.name,
            "gid": self.gid,
            "mtu": int(self.mtu),
            "qpn": {
                f"{peer}/{channel}": qp.qp_num
                for (peer, channel), qp in zip(self.links, self.qps, strict=True)
            },
        }

    def connect(self, link: int, rank: int, peer: dict[str, Any]) -> None:
        """Take the queue pair of ``link`` to RTS against the peer's record."""
        peer_rank, channel = self.links[link]
        attr = QPAttr(qp_state=e.IBV_QPS_INIT, cur_qp_state=e.IBV_QPS_RESET)
        attr.port_num = self.port
        attr.pkey_index = 0
        attr.qp_access_flags = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE
        attr.path_mtu = min(int(self.mtu), int(peer["mtu"]))
        attr.dest_qp_num = int(peer["qpn"][f"{rank}/{channel}"])
        attr.rq_psn = attr.sq_psn = 0
        attr.max_dest_rd_atomic = attr.max_rd_atomic = 1
        attr.min_rnr_timer = 1  # 0.01 ms: a receiver out of posted receives is retried quickly
        attr.timeout = 14  # 4.096 us * 2^14 = 67 ms per try
        attr.retry_cnt = 7
        attr.rnr_retry = 7  # infinite: flow control is the protocol's job, RNR only a backstop
        route = GlobalRoute(dgid=GID(peer["gid"]), sgid_index=self.gid_index, hop_limit=64)
        attr.ah_attr = AHAttr(port_num=self.port, is_global=1, gr=route)
        try:
            self.qps[link].to_rts(attr)
        except Exception as err:
            raise ConfigError(
                f"cannot connect to rank {peer_rank}'s queue pair ({err}): with RoCE this usually means "
                f"GID {self.gid_index} ({self.gid}) cannot reach {peer['gid']}; set RINGCORE_IB_GID_INDEX "
                "to a RoCE v2 GID with an address both hosts route (not link-local on lo)"
            ) from None

    # -- rdma.Device --------------------------------------------------------------------------

    def register(self, address: int, nbytes: int, writable: bool) -> Any:
        access = e.IBV_ACCESS_LOCAL_WRITE | e.IBV_ACCESS_REMOTE_WRITE if writable else 0
        try:
            return MR(self.pd, nbytes, access, address=address)
        except Exception as err:
            raise _registration_error(err, nbytes) from None

    def post_recv(self, link: int, slot: int, address: int, nbytes: int, lkey: int) -> None:
        wr = self._recv_wrs.get((link, slot))
        if wr is None:
            sge = SGE(address, nbytes, lkey)
            wr = self._recv_wrs[(link, slot)] = RecvWR(
                wr_id=_RECV_FLAG | link << 16 | slot, num_sge=1, sg=[sge]
            )
        self.qps[link].post_recv(wr)

    def post_send(self, link: int, data: bytes) -> None:
        self._inline[: len(data)] = data
        self._control_sge.length = len(data)
        wr = self._control_wr
        wr.sg_list = self._control_sge
        wr.wr_id = link
        self.qps[link].post_send(wr)

    def post_write(
        self, link: int, address: int, nbytes: int, lkey: int, remote: int, rkey: int, imm: int
    ) -> None:
        sge, wr = self._write_sge, self._write_wr
        sge.addr, sge.length, sge.lkey = address, nbytes, lkey
        wr.sg_list = sge
        wr.wr_id = link
        wr.imm_data = imm
        wr.set_wr_rdma(rkey, remote)
        self.qps[link].post_send(wr)

    def poll(self, limit: int) -> list[Completion]:
        count, wcs = self.cq.poll(limit)
        if not count:
            return []
        out = []
        for wc in wcs:
            received = bool(wc.wr_id & _RECV_FLAG)
            link = (wc.wr_id >> 16) & 0xFFFF if received else wc.wr_id
            if wc.status != e.IBV_WC_SUCCESS:
                status = self._statuses.get(wc.status, f"status {wc.status}")
                out.append(Completion(link, SENT, False, status, 0, 0, 0))
                continue
            kind = SENT
            if received:
                kind = WRITTEN if wc.opcode == e.IBV_WC_RECV_RDMA_WITH_IMM else RECEIVED
            out.append(Completion(link, kind, True, "", wc.wr_id & 0xFFFF, wc.byte_len, wc.imm_data))
        return out

    def arm(self) -> None:
        self.cq.req_notify()

    def consume_event(self) -> None:
        self.channel.get_cq_event(self.cq)  # the fd was readable: this does not block
        self.cq.ack_events(1)

    def close(self) -> None:
        for obj in [*self.qps, self.cq, self.channel, self.pd, self.ctx]:
            with contextlib.suppress(Exception):
                obj.close()

    def _warn_memlock(self) -> None:
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if soft != resource.RLIM_INFINITY and soft < 64 << 20 and os.geteuid() != 0:
            log.warning(
                "locked-memory limit is %d KiB (ulimit -l): RDMA registers whole buffers and larger "
                "ones will fail; raise it (ulimit -l unlimited, or docker --ulimit memlock=-1)",
                soft // 1024,
            )


def open_device(
    settings: Settings, rank: int, size: int, channels: int
) -> tuple[VerbsDevice | None, dict[str, Any]]:
    """Open the device and its queue pairs; ``(None, {"error": why})`` when RDMA can't be used here."""
    try:
        device = VerbsDevice(settings, needed_links(rank, size, channels))
    except ConfigError as err:
        return None, {"error": str(err)}
    return device, device.record()


def connect(
    rank: int,
    size: int,
    channels: int,
    device: VerbsDevice,
    records: list[dict[str, Any]],
    control: TcpTransport,
    store: Any,
    timeout: float,
) -> RdmaTransport:
    """Connect every queue pair, post the control receives, and wait until every rank has."""
    for index, (peer, _channel) in enumerate(device.links):
        device.connect(index, rank, records[peer])
    transport = RdmaTransport(rank, size, channels, device, device.links, control)
    transport.post_receives()
    store.set(f"ib/ready/{rank}", 1)
    for peer in range(size):
        try:
            store.get(f"ib/ready/{peer}", timeout)
        except CollectiveTimeout:
            transport.close()
            raise CollectiveTimeout(
                f"rank {rank}: rank {peer} did not finish connecting its RDMA queue pairs within {timeout:g} s"
            ) from None
    return transport


def choose_gid_index(device: str, port: int) -> int:
    """The first usable RoCE v2 GID: IPv4-mapped first, then any other routable one.

    Raises:
        ConfigError: no such GID (say which index to set instead, if any).
    """
    base = f"{SYSFS}/{device}/ports/{port}"
    try:
        count = len(os.listdir(f"{base}/gids"))
    except OSError:
        return 0
    candidates = []
    for index in range(count):
        gid, kind, netdev = (
            _read(f"{base}/{path}/{index}") for path in ("gids", "gid_attrs/types", "gid_attrs/ndevs")
        )
        if not gid or not gid.replace(":", "").strip("0"):
            continue
        if kind == "IB":  # InfiniBand link layer: the port GID always works
            return index
        if "v2" not in kind or (gid.startswith("fe80:") and netdev == "lo"):
            continue
        candidates.append((0 if gid.startswith("0000:0000:0000:0000:0000:ffff:") else 1, index))
    if not candidates:
        raise ConfigError(
            f"no usable RoCE v2 GID on {device} port {port} (see {base}/gids and gid_attrs/types); "
            "give the interface an IP address or set RINGCORE_IB_GID_INDEX"
        )
    return min(candidates)[1]


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _first_active_device(port: int) -> str:
    try:
        names = [dev.name.decode() for dev in _device.get_device_list()]
    except Exception as err:  # libibverbs fails when there is no RDMA subsystem at all
        names, why = [], f" ({err})"
    else:
        why = ""
    if not names:
        raise ConfigError(
            f"no RDMA device found{why}: `ibv_devices` lists none. Load the driver (e.g. rdma_rxe for "
            "Soft-RoCE) or set RINGCORE_TRANSPORT=tcp"
        )
    for name in names:
        if _read(f"{SYSFS}/{name}/ports/{port}/state").startswith(str(PORT_ACTIVE)):
            return name
    return names[0]


def _open_context(name: str) -> Any:
    try:
        return _device.Context(name=name)
    except Exception as err:
        raise ConfigError(
            f"cannot open RDMA device {name!r} ({err}); check RINGCORE_IB_DEVICE / ibv_devices"
        ) from None


def _completion_channel(ctx: Any) -> tuple[Any, int]:
    """A completion channel and its file descriptor (pyverbs does not expose it: find it in /proc)."""
    before = _event_fds()
    channel = CompChannel(ctx)
    new = _event_fds() - before
    if len(new) != 1:
        channel.close()
        raise ConfigError("cannot find the completion channel's file descriptor in /proc/self/fd")
    return channel, new.pop()


def _event_fds() -> set[int]:
    fds = set()
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{name}") == _EVENT_LINK:
                fds.add(int(name))
    return fds


def _bytearray_address(buf: bytearray) -> int:
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def _registration_error(err: Exception, nbytes: int) -> ConfigError:
    code = getattr(err, "error_code", None) or getattr(err, "errno", None)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if code in (errno.ENOMEM, errno.EPERM, errno.EAGAIN) or "Cannot allocate memory" in str(err):
        limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft // 1024} KiB"
        return ConfigError(
            f"cannot register {nbytes} bytes with the RDMA device ({err}): the locked-memory limit is {limit}; "
            f"RDMA pins whole buffers, so `ulimit -l` must be at least {-(-nbytes // 1024)} KiB plus what is "
            "already registered. Run `ulimit -l unlimited` before launching (docker: --ulimit memlock=-1; "
            "systemd: LimitMEMLOCK=infinity; /etc/security/limits.conf: memlock unlimited)"
        )
    return ConfigError(f"cannot register {nbytes} bytes with the RDMA device: {err}")
