"""What an elastic job's launcher and its workers say to each other, through the launcher's store.

Words. The launcher (:mod:`ringcore.elastic_driver`) starts *workers*,
numbered 0, 1, ... for the whole job. A *generation* is one world: the
workers the launcher names, in rank order, and the communicator they build
(:mod:`ringcore.elastic_rendezvous`). It *ends* when a member fails or
leaves, or when the launcher wants the world to change (workers wait to
join, a host left the discovery script's list); the members then check in
again and the next generation begins.

The keys, in the store ``ringcore-run`` serves at ``RINGCORE_ADDR:RINGCORE_PORT``
(authenticated with the job's secret, like every ringcore store):

- ``elastic/ready/<w>`` = ``[seq, generation]``: worker ``w`` checks in for the
  ``seq``-th time, leaving ``generation`` (0: it has none yet).
- ``elastic/answer/<w>/<seq>`` = ``[g, rank, size]``: the launcher's answer to
  that check-in, once it has decided generation ``g``. A worker it leaves out
  gets no answer: the launcher stops it.
- ``elastic/ended`` = the newest generation the launcher has ended. Rank 0
  reads it at every commit, so healthy ranks leave together at a commit.
- ``elastic/broken`` = the newest generation a member left unasked (it died,
  or saw a peer fail): ranks still waiting to meet it stop waiting.
- ``elastic/g<g>/...``: generation ``g``'s meeting. Its rank 0 serves the
  generation's own store on a port the kernel picks and publishes it there
  (:func:`ringcore.new_communicator`), so no generation meets at another's
  keys or ports.
"""

from __future__ import annotations

ENDED = "elastic/ended"
BROKEN = "elastic/broken"
WORKER_VARIABLE = "RINGCORE_ELASTIC_WORKER"  # set by ringcore-run for each worker of an elastic job


def ready_key(worker: int) -> str:
    """Where ``worker`` checks in."""
    return f"elastic/ready/{worker}"


def answer_key(worker: int, seq: int) -> str:
    """Where the launcher answers ``worker``'s ``seq``-th check-in."""
    return f"elastic/answer/{worker}/{seq}"


def meeting_prefix(generation: int) -> str:
    """The keys under which generation ``generation``'s ranks meet."""
    return f"elastic/g{generation}/"
