"""Task functions the test cluster runs on each rank: ``fn(comm, *args)``, picklable by name.

A test writes ``from tests import tasks`` and passes ``tasks.allreduce`` (say) to
``Cluster.results``; the cluster pickles the function by its defining module and
name (``tests.tasks.collectives.allreduce``), and each rank imports that module:
the forkserver preloads this package, hence every module below. This file
re-exports every task, so ``tasks.<name>`` works whichever module defines it.

- ``collectives``: each collective once, async batches, timed barriers, torch tensors.
- ``validation``: bad arguments refused before anything is sent.
- ``faults``: fault injection from inside a rank (no collective of its own).
- ``failures``: collectives that fail, and what the error and buffer say.
- ``lifecycle``: rank programs outside a Cluster (init, shutdown, re-init).
- ``soak_plan``: the seeded batch of mixed collectives the soak tests run.
- ``plans``: the algorithm, kept plans and plan cache a communicator uses.
- ``endpoints``: a rank's store, listeners, links and transport.
- ``symmetric``: arrays from ``comm.empty`` and the direct allreduce on them.
- ``direct``: the direct allreduce of ordinary buffers: routes, faults, late writers.
"""

from tests.tasks.collectives import (
    allgather,
    allreduce,
    allreduce_async,
    allreduce_async_many,
    allreduce_checked_until,
    allreduce_with_torch_on,
    async_new_arrays,
    barrier,
    barrier_times,
    broadcast,
    identity,
    loop_allreduce,
    per_rank,
    reduce_scatter,
    timeline_job,
    torch_allreduce,
)
from tests.tasks.direct import (
    allreduce_of_rank_counts,
    allreduce_reduced_by,
    allreduce_routed,
    allreduce_switching_buffers,
    can_copy,
    kernel_copies,
    late_writer,
    mailbox_posts,
    posted_collectives,
)
from tests.tasks.endpoints import listening_report, repeated_allreduce, store_address, transport_report
from tests.tasks.failures import (
    allreduce_until_failure,
    check_then_allreduce,
    exit_or_barrier,
    exposed_range,
    fault_rounds,
    mismatch_then_retry,
    op_by_rank,
    other_count_past_2_32,
    other_op_on_rank_0,
    partial_sums_after_fault,
    sliced_allreduce_until_failure,
    untouched_except_noted,
)
from tests.tasks.faults import SendTrigger, _hook_phase, fault_in_round_one
from tests.tasks.lifecycle import (
    init_and_report,
    init_shutdown_cycles,
    init_with_fault,
    lifecycle_cycles,
    reinit_after_failure,
)
from tests.tasks.plans import (
    allreduce_algorithm,
    allreduce_on_mixed_paths,
    allreduce_recording_algorithms,
    kept_layouts,
    many_layouts,
    small_route,
)
from tests.tasks.soak_plan import SOAK_DTYPES, soak, soak_input, soak_spec
from tests.tasks.symmetric import (
    allreduce_symmetric,
    allreduce_symmetric_on,
    direct_then_fault,
    empty_of_rank_sizes,
    symmetric_is_mapped,
)
from tests.tasks.validation import bad_input

# _hook_phase is private but exported: the rank program test_faults launches with ringcore-run calls it.
__all__ = [
    "SOAK_DTYPES",
    "SendTrigger",
    "_hook_phase",
    "allgather",
    "allreduce",
    "allreduce_algorithm",
    "allreduce_async",
    "allreduce_async_many",
    "allreduce_checked_until",
    "allreduce_of_rank_counts",
    "allreduce_on_mixed_paths",
    "allreduce_recording_algorithms",
    "allreduce_reduced_by",
    "allreduce_routed",
    "allreduce_switching_buffers",
    "allreduce_symmetric",
    "allreduce_symmetric_on",
    "allreduce_until_failure",
    "allreduce_with_torch_on",
    "async_new_arrays",
    "bad_input",
    "barrier",
    "barrier_times",
    "broadcast",
    "can_copy",
    "check_then_allreduce",
    "direct_then_fault",
    "empty_of_rank_sizes",
    "exit_or_barrier",
    "exposed_range",
    "fault_in_round_one",
    "fault_rounds",
    "identity",
    "init_and_report",
    "init_shutdown_cycles",
    "init_with_fault",
    "kept_layouts",
    "kernel_copies",
    "late_writer",
    "lifecycle_cycles",
    "listening_report",
    "loop_allreduce",
    "mailbox_posts",
    "many_layouts",
    "mismatch_then_retry",
    "op_by_rank",
    "other_count_past_2_32",
    "other_op_on_rank_0",
    "partial_sums_after_fault",
    "per_rank",
    "posted_collectives",
    "reduce_scatter",
    "reinit_after_failure",
    "repeated_allreduce",
    "sliced_allreduce_until_failure",
    "small_route",
    "soak",
    "soak_input",
    "soak_spec",
    "store_address",
    "symmetric_is_mapped",
    "timeline_job",
    "torch_allreduce",
    "transport_report",
    "untouched_except_noted",
]
