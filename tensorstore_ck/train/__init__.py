"""Training helpers: exact resume of a training run, and when to snapshot it.

    loader = ResumableDataLoader(dataset, batch_size=32, shuffle=True, num_workers=2, seed=0)
    ts = TrainState(model=model, optimizer=opt, scheduler=sched, dataloader=loader)
    mgr = CheckpointManager(store, job="run1", state=ts, every_steps=100,
                            retention=Retention(keep_last=3))
    step = mgr.restore_latest() or 0
    while step < total_steps:
        for x, y in loader:               # a resumed epoch yields exactly the remaining batches
            step += 1
            ...train...
            mgr.step(step, metrics={"loss": loss.item()})
    mgr.close()

Resume is bit-identical when everything random flows from state TrainState
captures: model, optimizer, scheduler and grad-scaler state, every RNG stream
(python, numpy's global state and the numpy Generators handed to it, torch CPU
and each CUDA device) and the data-loader position. ResumableDataLoader makes
the data side exact: epoch e's order is a permutation drawn from (seed, e), and
the dataset's own randomness (python random, numpy and torch global RNGs used
inside __getitem__) is reseeded per batch from (seed, e, batch index) in
whichever process fetches it. A batch is therefore the same whether it comes
from worker 0, worker 1 or the main process, and whether the epoch was resumed
in the middle or not.

One job a module: state.py (TrainState, the RNG streams), manager.py (CheckpointManager:
when to snapshot, and its snapshots taken), with its parts in watch.py (the on_commit
hook, the store's size), outcomes.py (failures, CloseReport), collective.py (under
torch.distributed), together.py (its collective restores) and restoring.py (restore_latest,
restore(step), the steps kept).

Its modules:

    pruner.py         a training job's retention applied while it trains, in the background
                      (CheckpointManager's and the Hugging Face callback's)
    state.py          TrainState: the objects' state and every RNG stream, captured and put back
    manager.py        CheckpointManager: when to snapshot, and the snapshots taken
    preempt.py        preemption signals caught and chained; Preempted, the process's end
    continuous.py     the continuous trigger's question: is the previous snapshot durable yet
    watch.py          its on_commit and on_durable hooks, CommitEvent, the store's size measured
    outcomes.py       its failures, warned and counted; CloseReport
    collective.py     under torch.distributed: rank 0 decides, collective snapshots
    together.py       collective restores: every rank the same step, or the same error
    restoring.py      restore_latest, restore(step), the steps kept, a rollback recorded
    loader.py         ResumableDataLoader: the data order, resumed exactly
"""

from .manager import CheckpointManager
from .outcomes import CloseReport
from .preempt import Preempted
from .state import TrainState, capture_rng, restore_rng
from .watch import CommitEvent

__all__ = ["TrainState", "CheckpointManager", "CommitEvent", "CloseReport", "Preempted", "capture_rng", "restore_rng"]
