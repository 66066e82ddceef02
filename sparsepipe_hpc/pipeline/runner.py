"""One rank's pipelined model: its stage's blocks, the carry plan, the schedule and the executor.

    from sparsepipe_hpc.pipeline.executor import split_batch
    ctx = ParallelContext(comm, RankLayout.from_world(comm.size, stages=2))
    pipe = Pipeline(model, ctx, balance="3,3", schedule="1f1b", micro_batches=4)  # collective
    parts = split_batch(batch_x, pipe.micro_batches, labels)     # whole samples per micro-batch
    local = [ctx.distribute(x, y, align=model.total_stride) for x, y in parts]
    shares = pipe.run([x for x, _ in local], [x.context for x, _ in local], loss_fn,
                      step=lambda: (ctx.allreduce_gradients(pipe.parameters()), opt.step()))
    pipe.close(); ctx.close()                                      # collective, at the end

Every rank holds the whole model (so one seed or one broadcast initializes every stage alike) and
runs ``model.blocks[a:b]`` of its stage; ``parameters()`` are the ones its optimizer and its
gradient all-reduce (ParallelContext.allreduce_gradients over the stage's ranks) cover.

BatchNorm in training mode normalizes each micro-batch by its own statistics over the stage's
ranks (GPipe's semantics): the result equals the single-process run over the same micro-batches
(micro-batch i of the global batch = every replica's micro-batch i), not the unsplit batch.
The running statistics by default take one momentum update per micro-batch, as that same
single-process run does (so it stays the exact oracle, and BatchNorm needs no pipeline hook).
``deferred_bn=True`` (trainer ``--deferred-bn``; torchgpipe's DeferredBatchNorm) instead
accumulates each micro-batch's statistics and folds them in once at the end of :meth:`run`: one
update per mini-batch from all its voxels (the unpipelined run's for the first BatchNorm; deeper
ones see inputs normalized per micro-batch), while loss and gradients are unchanged (forward
still normalizes per micro-batch). See sparsepipe_hpc.nn.layers.BatchNorm.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, Optional, Sequence

import torch

from halo.transport.base import Transport
from halo.transport.mpi import MPITransport
from sparsepipe_hpc.nn.layers import commit_batchnorm, set_deferred_batchnorm
from sparsepipe_hpc.parallel.failures import disagreement, run_on_all
from sparsepipe_hpc.pipeline.carry import CarryPlan, PipelineError, parse_balance, plan_carry
from sparsepipe_hpc.pipeline.executor import StageExecutor
from sparsepipe_hpc.pipeline.p2p import GRAD, StageLink, TransferError, tag
from sparsepipe_hpc.pipeline.schedule import Schedule, make_schedule
from sparsepipe_hpc.sparse import SparseTensor

__all__ = ["Pipeline", "even_balance"]


def even_balance(num_blocks: int, stages: int) -> tuple[int, ...]:
    """Blocks per stage as equal as counts allow (the first stages get the extra ones)."""
    if stages > num_blocks:
        raise PipelineError(f"{stages} stages need at least {stages} blocks but the model has "
                            f"{num_blocks}; pass --stages <= {num_blocks}")
    q, r = divmod(num_blocks, stages)
    return tuple(q + (1 if s < r else 0) for s in range(stages))


class Pipeline:
    """This rank's stage of ``model`` under ``ctx``'s layout (collective: every rank of the job
    constructs it, with the same arguments).

    ``balance``: blocks per stage ("5,4" or a sequence; None: :func:`even_balance`), one entry per
    stage of ``ctx.layout``. Stage messages travel on a duplicate of ``ctx.world`` (so stage tags
    never meet other traffic): headers through MPI on the host, payloads through
    ``transport(comm)`` when given (e.g. host-staged MPI for device tensors; see
    :class:`~sparsepipe_hpc.pipeline.p2p.StageLink`), else MPI too. Received payloads land on the
    device of the model's parameters. ``deferred_bn``: switch this stage's BatchNorms to
    deferred running statistics (True) or per-micro-batch updates (False); None leaves them.
    ``autocast``: a context every forward (blocks and loss) runs in, e.g. bf16 autocast (then
    carries travel in bf16 and their gradients come back in it).

    What only one rank can check about a stage message (a header over its size limit,
    micro-batch or carry counts that disagree between sender and receiver) raises on that rank
    alone, while its peers wait for it: run under ``python -m launch run`` or call
    :func:`launch.run.abort_on_exception` (the trainer does), so such an error ends the job.
    """

    def __init__(self, model: Any, ctx: Any, balance: Optional[str | Sequence[int]] = None,
                 schedule: str = "1f1b", micro_batches: int = 1,
                 transport: Optional[Callable[[Any], Transport]] = None,
                 deferred_bn: Optional[bool] = None,
                 autocast: Callable[[], ContextManager[Any]] = contextlib.nullcontext):
        stages = ctx.layout.stages
        n = len(model.blocks)
        # Collective: the ranks agree on the split first (two small allgathers), so a rank whose
        # balance fails or differs stops them all, rather than hang them or own other blocks.
        outcome = run_on_all(ctx.world, lambda: even_balance(n, stages) if balance is None
                             else parse_balance(balance, n, stages))
        if outcome.failures:
            rank, _, msg = outcome.failures[0]
            alone = len(outcome.failures) < outcome.size
            raise PipelineError(f"{msg} (rank {rank})" if alone else msg)
        parts = outcome.value
        differ = disagreement(ctx.world, (tuple(parts), schedule, micro_batches, n))
        if differ:
            raise PipelineError("the ranks must build the Pipeline with the same balance, "
                                f"schedule, micro-batches and model; got {differ}")
        try:  # here, where every rank raises alike, not at that micro-batch on some ranks
            tag(micro_batches - 1, GRAD)
        except TransferError as e:
            raise PipelineError(str(e)) from None
        self.plan: CarryPlan = plan_carry([b.carry_arity for b in model.blocks], parts)
        self.schedule: Schedule = make_schedule(schedule, stages, micro_batches,
                                                skips=self.plan.skips)
        self.balance = parts
        self.micro_batches = micro_batches
        self.stage = ctx.position.stage
        self.is_first, self.is_last = self.stage == 0, self.stage == stages - 1
        a, b = self.plan.stages[self.stage].blocks
        self.blocks = model.blocks[a:b]
        if deferred_bn is not None:
            set_deferred_batchnorm(self.blocks, deferred_bn)
        pos, layout = ctx.position, ctx.layout
        self._comm = comm = ctx.world.Dup()
        self._replica = comm.Split(pos.replica, comm.Get_rank())  # this pipeline's ranks
        headers = MPITransport(comm)
        self.device = next(iter(model.parameters()), torch.empty(0)).device
        link = StageLink(transport(comm) if transport is not None else headers, headers,
                         self.device)
        self.executor = StageExecutor(self.blocks, self.plan, self.schedule, self.stage, link,
                                      lambda s: layout.rank_of(pos.replica, s, pos.spatial),
                                      autocast)

    def close(self) -> None:
        """Close the payload transport and free the stage messages' communicator (collective
        over the job, after the last :meth:`run`; closing again does nothing)."""
        from mpi4py import MPI

        self.executor.link.transport.close()
        if self._comm != MPI.COMM_NULL:
            self._replica.Free()
            self._comm.Free()

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        """This stage's parameters (the slice of the model this rank trains)."""
        return self.blocks.parameters()

    def run(self, inputs: Sequence[Optional[SparseTensor]], contexts: Sequence[Any],
            loss_fn: Optional[Callable[[int, Any], torch.Tensor]],
            step: Optional[Callable[[], None]] = None,
            backward: bool = True,
            last_backward: Optional[Callable[[], None]] = None,
            scale_loss: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
            ) -> list[torch.Tensor]:
        """One mini-batch through the schedule (StageExecutor.run's contract); loss shares of
        the micro-batches on the last stage, [] elsewhere. ``backward=False``: forward only
        (evaluation), ``loss_fn``'s results returned. ``last_backward``, ``scale_loss``: see
        StageExecutor.run.

        Stage 0 reads ``inputs`` (one per micro-batch; others may pass anything), the last stage
        calls ``loss_fn`` (others may pass None), every stage takes a context per micro-batch.
        The stages of this replica agree on those checks first (one small allgather), so a
        missing argument raises on every one of them, not on the stage that needs it while the
        others wait for its messages."""
        from mpi4py import MPI

        if self._comm == MPI.COMM_NULL:  # before any block runs or any state changes
            raise RuntimeError("Pipeline.run after close(); build a new Pipeline")
        m = self.micro_batches

        def check() -> None:
            if len(contexts) != m or (self.is_first and len(inputs) != m):
                raise PipelineError(f"the schedule has {m} micro-batches but run() got "
                                    f"{len(inputs)} inputs and {len(contexts)} contexts on stage "
                                    f"{self.stage}; pass one of each per micro-batch")
            if self.is_last and loss_fn is None:
                raise PipelineError(f"the last stage ({self.stage}) needs a loss_fn")

        outcome = run_on_all(self._replica, check)
        if outcome.failures:
            raise PipelineError(outcome.failures[0][2])
        shares = self.executor.run(inputs if self.is_first else [None] * self.micro_batches,
                                   contexts, loss_fn if self.is_last else None, step, backward,
                                   last_backward, scale_loss)
        commit_batchnorm(self.blocks)  # deferred BatchNorm: one update for the mini-batch
        return shares
