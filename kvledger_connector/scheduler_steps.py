"""The scheduler side's decisions as synchronous, thread-free step functions over plain values.

The twin of kvledger_connector/jobs.py (the worker side's steps). No vLLM object and no thread in here:
the connector's SchedulerSide (kvledger_connector/scheduler.py) adapts vLLM's Request, SchedulerOutput
and KVConnectorOutput to these calls, and the conformance driver (conformance/kvdriver.py) calls the same
functions one model action at a time, bringing only the schedule and the store.
"""
from __future__ import annotations


def max_job_blocks(max_model_len: int, block_size: int) -> int:
    """The most blocks one store job can pin: the longest request's table, ceil(max_model_len /
    block_size). A partial tail is the table's own last block (read in place, never a copy-on-write
    block outside the table), so it adds nothing."""
    return -(-max_model_len // block_size)
