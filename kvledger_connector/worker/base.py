"""What the worker's save steps and load steps share (kvledger_connector/worker/saves.py, loads.py): one rank's
ledgers, its block shape, the registered KV cache it was built from, its counting and its kept errors; and
the model actions a job's generator stops at. No threads, no I/O, no lock: the caller serializes."""
from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING

from kvledger.errors import LedgerInputError
from kvledger.load import LoadLedger
from kvledger.worker import WorkerLedger, put_positions
from kvledger_connector.config import ConnectorConfig
from kvledger_connector.shape.block_shape import BlockShape
from kvledger_connector.shape.group_kind import ONE_FULL_ATTENTION, GroupKinds
from kvledger_connector.telemetry.stats import StatsRecorder
from kvledger_connector.worker.cache import Buffers, RegisteredCache
from kvledger_connector.worker.sent import SentBlocks

if TYPE_CHECKING:
    from kvledger_connector.shape.integrity import BlockSeal

logger = logging.getLogger("kvledger_connector.worker.steps")  # one logger for the steps, wherever they live

MAX_ERRORS_KEPT = 64  # handler errors remembered for inspection (bounded)


class JobAction(enum.Enum):
    """The model action (tla/KVLedger.tla) a job's generator has just done; the value is its name there.
    START is not a model action: a save job taken from the queue, nothing done yet."""
    START = "Start"
    DMA_READ = "DmaRead"
    PUT = "Put"
    REPORT = "Report"
    EMIT_LOAD = "EmitLoad"
    LOAD = "Load"


class StepsBase:
    """One rank's state under its step functions; `WorkerSteps` (kvledger_connector/worker/steps.py) is built
    whole from it."""

    def __init__(self, config: ConnectorConfig, cache: RegisteredCache, *, ledger: WorkerLedger,
                 loads: LoadLedger, tp_rank: int, shape: BlockShape | None = None,
                 stats: StatsRecorder | None = None, stripe: tuple[int, int] | None = None) -> None:
        """``config``: the connector's, checked whole where it was built (its ``block_size``, and its store's
        ``load_sub_batch_keys`` and put retries). ``cache``: the registered KV cache (or a driver's buffers),
        one value, never changed. ``ledger.max_requests`` also bounds the `SentBlocks` tables (one per
        request generation). ``shape``: this rank's block (kvledger_connector/shape/block_shape.py), its
        parts' key builders; None: no keys, every job fails. ``stripe``: (this rank's replica index,
        replicas) among ranks that share keys (`kvledger.put_positions`); default the shape's, else (0, 1)."""
        if not isinstance(config, ConnectorConfig):
            raise LedgerInputError("config", type(config).__name__, "must be a ConnectorConfig")
        if not isinstance(cache, RegisteredCache):
            raise LedgerInputError("cache", type(cache).__name__, "must be a RegisteredCache")
        if shape is not None and not isinstance(shape, BlockShape):
            raise LedgerInputError("shape", type(shape).__name__, "must be a BlockShape")
        self.ledger = ledger
        self.loads = loads
        self.cache = cache
        self.tp_rank = tp_rank
        self.block_size = config.block_size
        # swapped whole by a weights-version switch (`BlockShape.rekeyed`); a job reads it once
        self.shape = shape
        if stripe is None:
            stripe = shape.stripe if shape is not None else (0, 1)
        put_positions(0, 0, *stripe)  # checks it
        self.stripe = stripe
        self.sub_batch = cache.sub_batch if cache.sub_batch is not None else config.store.load_sub_batch_keys
        # a full memory segment with the disk tier frees room each heartbeat: its keys are put again (bounded)
        self.full_retries = config.store.full_put_retries if config.store.disk_offload else 0
        self.full_retry_s = config.store.full_put_retry_ms / 1000
        self.stats = stats or StatsRecorder()
        self.sent = SentBlocks(ledger.max_requests, counts=self.stats)
        # keys of objects that failed their integrity tag, in order, each once (bounded): removed by
        # the store's own thread (`take_removals`), never on the thread that loaded (a sync load runs on
        # the model runner's)
        self.removals: dict[str, None] = {}
        # loads finished and not yet reported, in order (bounded by loads in flight); a list, not a set: two
        # loads of one reused req_id may finish before a step takes them, and each must be reported
        self.finished_loads: list[str] = []
        # sync loads (run inside the step, before the forward) finished and not yet reported, in order;
        # reported in the worker metadata's completed_loads, not through vLLM's finished_recving
        self.finished_sync_loads: list[str] = []
        # async loads finished with a block not loaded, in order (several KV cache groups: reported per
        # request in vLLM's failed_recving, with the load's finished_recving)
        self.failed_loads: list[str] = []
        self.errors: list[str] = []  # handler errors (bounded); tests assert it stays empty

    # the registered KV cache, read through these
    @property
    def buffers(self) -> Buffers:
        return self.cache.buffers

    @property
    def key_bytes(self) -> int:
        return self.cache.key_bytes

    @property
    def seal(self) -> BlockSeal | None:
        return self.cache.seal

    @property
    def num_blocks(self) -> int | None:
        return self.cache.num_blocks

    @property
    def kinds(self) -> GroupKinds:
        """Its KV cache groups' kinds (`BlockShape.kinds`, the scheduler side's rules too): whether a job's ids
        are one table's every block, and whether a failed load is reported by block or per request."""
        return ONE_FULL_ATTENTION if self.shape is None else self.shape.kinds

    @property
    def num_groups(self) -> int:
        """KV cache groups of this rank's blocks (a SaveSpec's ids per block, a LoadSpec's group range)."""
        return self.shape.num_groups if self.shape is not None else 1

    @property
    def keys_per_block(self) -> int:
        """A block's keys in its KV cache group (`BlockShape.keys_per_block`)."""
        return self.shape.keys_per_block if self.shape is not None else 1

    def block_shape(self) -> BlockShape:
        if self.shape is None:
            raise LedgerInputError("shape", None, "a BlockShape (its parts' KeyBuilders) is needed to turn block "
                                   "hashes into keys")
        return self.shape

    def note_error(self, msg: str) -> None:
        logger.error("kvledger worker r%d: %s", self.tp_rank, msg)
        if len(self.errors) < MAX_ERRORS_KEPT:
            self.errors.append(msg)

