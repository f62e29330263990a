"""DDP communication hooks that give DistributedDataParallel ringcore's wire compression.

Register one on a model whose process group is a "ringcore" group::

    import ringcore.torch
    from ringcore.torch.ddp_hooks import fp16_compress_hook

    dist.init_process_group("ringcore")
    model = DistributedDataParallel(model)
    model.register_comm_hook(None, fp16_compress_hook)  # None: the default group, or a ringcore group

:func:`fp16_compress_hook` allreduces each gradient bucket in place with
``op="avg"`` and ``compression="fp16"``: float16 on the wire, accumulation
in the bucket's dtype (float32), so every rank ends with bit-identical
gradients within one fp16 rounding per hop of the exact mean. It halves the
bytes on the wire, as torch's ``default_hooks.fp16_compress_hook`` does, but
torch's casts the whole bucket to float16 and sums in float16; ringcore
converts segment by segment and never holds an fp16 copy of the bucket.
Partial sums travel in float16, so the sum of a gradient over the ranks must
stay within ±65504 (larger values become inf, as with torch's hook).
"""

# No ``from __future__ import annotations``: DDP compares the hook's annotations with the real types.
import torch
import torch.distributed as dist

from ringcore.torch.process_group import ringcore_group

__all__ = ["fp16_compress_hook"]


def fp16_compress_hook(
    state: dist.ProcessGroup | None, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average ``bucket``'s gradients over the group with float16 on the wire (DDP comm hook).

    Args:
        state: the "ringcore" process group DDP reduces over, or None for the default group.
        bucket: the bucket DDP hands to the hook.

    Returns:
        A future of the bucket's buffer, averaged in place; it fails with the
        collective's error (a ``RuntimeError`` naming ``PeerFailure``...) if a peer fails.

    Raises:
        TypeError: ``state`` (or the default group) is not a "ringcore" group.
    """
    work = ringcore_group(state).allreduce_tensor(bucket.buffer(), op="avg", compression="fp16")
    return work.get_future()
