"""Names in tensorstore_ck/ that nothing in the package calls, kept because something
outside it does: the public API's users, torch, transformers, Lightning, pickle, the
interpreter, or the tests. vulture reads this file as if it were code that uses each
name, so `python -m vulture tensorstore_ck tests/dead_code_whitelist.py --min-confidence 60`
lists only what nothing uses; tests/house/test_dead_code.py runs that check and fails on a
new finding, and on an entry here that no finding needs any more.

One name a line, with who uses it. vulture matches names, not owners: an entry covers
every definition of that name in the package. A definition nothing uses is removed, not
added here."""

# ruff: noqa
# type: ignore
_ = None

# -- the interpreter and the standard library call these --------------------------------
_.__getattr__  # module __getattr__ of __init__.py and format/dtypes.py: lazy exports (PEP 562)
_.__dir__  # module __dir__ of __init__.py: dir(tensorstore_ck) lists the lazy exports
_.exc_type  # Store.__exit__'s first argument: the context-manager protocol passes it
_.find_class  # listing._PlainUnpickler: pickle.Unpickler calls it for every global
_._before_fork  # RefTable hooks called by name through os.register_at_fork (refs/base.py _each)
_._after_fork_parent  # same: the parent's side of os.register_at_fork

# -- botocore's adaptive retry limiter calls these on its rate adjustor (storage/aimd.py AimdRate) --
_.success_received  # AimdRate: ClientRateLimiter calls it on every answer that is not throttled
_.error_received  # AimdRate: ClientRateLimiter calls it on a throttled answer

# -- torch.distributed.checkpoint calls these (StorageReader / StorageWriter / AsyncStager) --
_.validate_checkpoint_id  # TsckReader, TsckWriter: DCP asks whether a checkpoint_id is theirs
_.read_metadata  # TsckReader
_.set_up_storage_reader  # TsckReader
_.set_up_storage_writer  # TsckWriter
_.prepare_local_plan  # TsckReader, TsckWriter
_.prepare_global_plan  # TsckReader, TsckWriter
_.read_data  # TsckReader
_.write_data  # TsckWriter
_.should_synchronize_after_execute  # TsckWriter as an AsyncStager (dcp.async_save)
_.synchronize_staging  # TsckWriter as an AsyncStager

# -- transformers calls these (TrainerCallback) -----------------------------------------
_.on_init_end  # TsckCallback
_.on_train_begin  # TsckCallback
_.on_save  # TsckCallback
_.on_train_end  # TsckCallback
_.on_step_end  # TsckCallback (preemption)
_.should_training_stop  # TrainerControl: read by the Trainer

# -- Lightning calls these (CheckpointIO) -----------------------------------------------
_.on_train_start  # TsckPreemption (a Lightning Callback)
_.on_train_batch_end  # TsckPreemption (a Lightning Callback)
_.on_exception  # TsckPreemption
_.teardown  # TsckPreemption
_.remove_checkpoint  # TsckCheckpointIO

# -- psycopg reads this ----------------------------------------------------------------
_.isolation_level  # refs/postgres.py sets it on a psycopg Connection (a property of psycopg's)
_.dl_state_dict  # accelerate.py sets it on accelerate's DataLoaderAdapter: what its state_dict() answers

# -- the public API: documented in README.md, used by training scripts and the tests --------
_.all_steps  # CheckpointManager.all_steps
_.latest_step  # CheckpointManager.latest_step
_.prune_errors  # CheckpointManager.prune_errors, TsckCallback.prune_errors
_.last_prune  # CheckpointManager.last_prune
# CommitEvent's fields, which the on_commit hook reads
_.since_last
_.prune_backlog
_.store_size
_.store_size_at
_.local_size
# GCReport's fields: store.gc() returns it, `tsck gc --json` prints them (to_json, asdict)
_.reachable_objects
_.temp_files_removed
_.malformed_rows
_.reflog_compacted
_.mark_seconds
_.list_seconds
_.sweep_seconds

# -- counters and inspection the tests read (what the package did, asserted from outside) ---
_.serving  # metrics.MetricsServer: whether this rank's start_http_server serves (one per host under torchrun; README, docs/guide/torchrun.md)
_.lock_waits  # PostgresRefTable: attempts that gave up on a lock (test_pg_lock_wait)
_.pool_waits  # PostgresRefTable: waits while the process's own calls held every connection (test_reftable)
_.reconnects  # PostgresRefTable (test_hostile_refs)
_.unknown_commits  # PostgresRefTable (test_hostile_refs, test_pg_unknown_outcome)
_.retries  # RetryingStore's count (test_blockstore); also s3fs's own attribute, set by S3BlockStore.fs
_.faults  # FaultInjectingStore: faults injected (test_faults, tests/sim)
_.streamed  # Peers: blocks a restore got by batched fetches from the holders (tier_dist_worker)
_.stream_fetches  # Peers: those batched fetches (tier_dist_worker: fewer than the blocks)
_.blocks_alone  # Peers: blocks a restore got one request each (tier_dist_worker: none for a lost node's ranks)
_.tidied  # Uploader: part rows dropped by _tidy (test_tier_dist)
_.tidy_busy  # Uploader: cleanups that met a gc holding the tier (tests/helpers/tier_dist_worker.py)
_.teed  # Uploader: blocks sent early (test_tier, test_tier_lazy)
_.tee_dropped  # Uploader: early sends dropped (test_tier)
_.sent_written  # Uploader: objects copied with a write record (test_tier_written)
_.opened  # LazyStorage.opened (tier/opening.py): whether the remote was reached yet (test_tier_lazy)
_.strangers  # Peers: connections refused for not proving they are the job's (test_shared_reads)
_.dcp_save  # TsckCheckpointManager (torchtitan.py): torchtitan's CheckpointManager calls its hooks (test_torchtitan)
_._purge_stale_checkpoints  # TsckCheckpointManager: called by torchtitan's _save after each save
_._load  # TsckCheckpointManager: called by torchtitan's BaseCheckpointManager.load
_.prefetch  # Store.prefetch: public, called by a restarting job first (test_prefetch, bench_restart)
