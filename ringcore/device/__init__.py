"""GPU buffers: collectives on device memory, staged through pinned host memory over any transport.

Theory of operation. A GPU buffer runs the same schedules as a host buffer
(:mod:`ringcore.algo`); only where bytes are staged and where reductions run
changes. The transport still moves host memoryviews, so every transport
works unchanged, and one that can register device memory (GPUDirect) can
later skip the staging without touching the algorithms.

* Send of segment k: (compress on the GPU into the wire dtype,) copy device
  -> pinned host on the *copy* stream, and post the send once that copy's
  event has fired.
* Receive of segment k: post the receive into a pinned slot; when it lands,
  copy host -> device on the *compute* stream, then reduce there
  (decompress-and-reduce when compressed). The slot is free again once the
  upload's event has fired.

Each connection and direction has its own few pinned slots (at least two:
double buffering), allocated once per communicator and reused; so the copy
of segment k+1 overlaps the network transfer of segment k and the
reduction of earlier segments, and host memory is bounded by
``RINGCORE_GPU_STAGING_BYTES`` per connection, not by the tensor size.

Modules: :mod:`~ringcore.device.layer` (the interface to a device runtime),
:mod:`~ringcore.device.cupy_layer` (CuPy, the real one),
:mod:`~ringcore.device.fake` (numpy with deferred streams, for tests),
:mod:`~ringcore.device.staging` (the staged executor),
:mod:`~ringcore.device.resources` (streams, slots and scratch kept per communicator).
The plans for device buffers are :mod:`ringcore.plans.device`.

Nothing here imports CuPy until a GPU buffer reaches a collective.
"""

from __future__ import annotations

from ringcore.device.layer import DeviceLayer

_active: DeviceLayer | None = None


def layer() -> DeviceLayer:
    """The device layer in use; the CuPy one unless :func:`use` chose another.

    Raises:
        TypeError: CuPy is not installed (a GPU buffer cannot be used then).
    """
    global _active
    if _active is None:
        from ringcore.device.cupy_layer import CupyLayer

        _active = CupyLayer()
    return _active


def use(new: DeviceLayer | None) -> DeviceLayer | None:
    """Make ``new`` the device layer (``None``: back to CuPy, lazily); returns the previous one."""
    global _active
    previous, _active = _active, new
    return previous
