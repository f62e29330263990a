"""Plans: one validated collective each, ready to run in its turn.

The layers, top down: :mod:`ringcore.api` -> :class:`~ringcore.comm.Communicator`
(validates through a plan's maker, keys layouts, orders calls) -> plans (this
package: what each collective does with the caller's buffer, its slices and
scratch) -> executors and schedules (:mod:`ringcore.algo`) -> transports
(:mod:`ringcore.transport`) and kernels (:mod:`ringcore.kernels`). A plan
receives the :class:`~ringcore.context.Context`, never the Communicator.

Every plan has the same face (:class:`~ringcore.plans.base.Plan`): ``kind``,
``nbytes``, ``details`` (for the timeline) and ``run(obj, seq)``, which the
Communicator calls in the collective's turn, blocking or on its async thread
alike. An allreduce of a numpy layout keeps its plan between calls
(:class:`~ringcore.plans.allreduce.AllreducePlan`, remembered by
:class:`~ringcore.plans.cache.PlanCache`); other collectives make a plan per
call (:class:`~ringcore.plans.base.CallPlan`).

Files: ``base.py`` (what a plan is; the runner of bound steps), ``validate.py``
(argument checks), ``allreduce.py``, ``broadcast.py``, ``gather.py`` (allgather,
reduce_scatter), ``barrier.py``, ``device.py`` (allreduce and broadcast of GPU
buffers, in the host plans' slices), ``cache.py`` (the allreduce plan cache).
"""
