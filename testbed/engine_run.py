"""Run vLLM 0.32's real engine on CPU with `EmuWorker` (testbed/emu_worker.py) and print one JSON result.

    python -m testbed.engine_run SPEC.json        (or the JSON itself as the argument)

The spec (all keys but `workdir` and `prompts` optional):

    workdir        where the tiny model dir is written (model path = part of the connector's keys)
    prompts        list of token-id lists; `passes` times each (default 2), `max_tokens` each (default 8)
    warmup_prompts token-id lists run once before pass 1, then reset_prefix_cache() (retried while the
                   connector holds pins): vLLM's CPU kernels are warm in pass 1 and the store holds only
                   these prompts' KV (not reported; with request_ids "fixed"/"per_pass" their ids are "w-req-<i>")
    tp, mp         tensor_parallel_size (1); VLLM_ENABLE_V1_MULTIPROCESSING (0: EngineCore in this process)
    backend        distributed_executor_backend: "uni" | "mp" (default: "uni" for tp 1, else "mp")
    connector      null (no connector) or {"extra": kv_connector_extra_config, "policy": "recompute"|"fail",
                   "role": "kv_both", "name": kv_connector (default "KVLedgerConnector"), "module_path":
                   kv_connector_module_path (default "kvledger_connector.connector"; null: a connector vLLM registers
                   itself, e.g. "MooncakeStoreConnector")}
    num_blocks (num_gpu_blocks_override), block_size, max_model_len, max_num_seqs, max_num_batched_tokens
    num_layers, num_kv_heads (all ranks), head_size      the tiny model (default 2, 2, 8)
    kv_kind        "per_rank" (default: the Llama model above), "replicated" (one KV head, which vLLM replicates
                   on every TP rank) or "mla" (a DeepSeek-V2 model: one latent of head_size per token)
    sliding_window a sliding-window model (not with "mla"): the config declares this window for its sliding
                   layers and full attention for every `full_every`-th layer (default 2: gpt-oss-like,
                   alternating; 6: Gemma-3-like), the worker reports SlidingWindowSpec / FullAttentionSpec, and
                   with vLLM's hybrid KV cache manager on there are several KV cache groups (default: none).
                   `full_every` 0: no full-attention layer, every layer sliding window (Mistral-like: the config
                   declares `sliding_window` without `layer_types`, vLLM copies it into
                   CacheConfig.sliding_window and plans one SlidingWindowSpec group)
    mamba          a Jamba-like Mamba hybrid (`emu_model.write_jamba_dir`, Mamba in vLLM's "align" mode): the worker
                   aligns the block size and reports MambaSpec / FullAttentionSpec (two KV cache groups)
    worker_cls     default testbed.emu_worker.EmuWorker (a subclass may inject faults)
    real_model     a real architecture instead of the stand-in: the name of a shipped config
                   (testbed/real_models/<name>/config.json) or a directory holding a config.json. The config is
                   copied into `workdir` (the model path is part of every key: tests never share keys), vLLM's
                   own CPU worker and model runner run the model with random weights (`load_format="dummy"`,
                   bf16 unless `dtype`), and `testbed.real_worker.ConnectorProbe` is mixed into the worker so
                   `workers` reports each rank's connector counters. Needs vLLM's CPU build. `kv_cache_bytes`
                   (default 64 MiB) sizes its KV cache unless `num_blocks` is given; `block_size` default 32
                   (CPU attention takes multiples of 32). The stand-in keys (`kv_kind`, `num_layers`, ...) are
                   ignored
    reset_between_passes   reset_prefix_cache() (retried while the connector holds pins) before passes > 0
    reset_connector        passes whose reset is reset_prefix_cache(reset_connector=True) (the connector's reset
                           hook: a new weights version from `weights_version_file` moves the keys)
    settle_timeout_s       bound on each reset_prefix_cache retry loop (default 60)
    shutdown_timeout_s     passed to the engine client's shutdown (default: vLLM's)
    request_ids    "fixed": every pass adds its requests itself (`llm_engine.add_request`) as "req-<i>" and
                   steps until they finish, so pass n reuses pass n-1's ids after they finished; sets
                   VLLM_DISABLE_REQUEST_ID_RANDOMIZATION=1 (else vLLM appends 8 random characters to every
                   id and the scheduler never sees an id twice). "per_pass": the same, but pass n's ids are
                   "p<n>-req-<i>" (no id is seen twice). Default: `LLM.generate`'s own ids
    progress       with request_ids "fixed" or "per_pass" (both meant by "fixed" below): print
                   `ENGINE_RUN_PROGRESS pass <n>: <done>/<total> requests` to stdout (flushed) whenever a
                   request finishes
    arrival_rate   with request_ids "fixed": open loop, request i of a pass arrives i / rate seconds after the
                   pass starts (added at the first step boundary from then on). Every pass reports its
                   `timeline`: its start "t0" (`time.monotonic()`) and per request its arrival, first token
                   and finish (seconds after t0) and tokens
    step_times     with request_ids "fixed": record every engine step's wall time (`llm_engine.step()`, the
                   whole EngineCore step when mp=0) per pass: `steps`, `step_s` {"sum", "median", "mean", "p90"}
    stall_timeout_s  with request_ids "fixed": raise when no request finished for this long (mp=0: the
                   message lists the scheduler's requests and their states)
    preload        list of "module:function" names, each called with no arguments in this process before vLLM
                   is imported (its return value is in the result's `preloaded`): a test double a driver
                   installs for one engine only (bench.engine installs testbed/cuda_event_stub.py's for
                   upstream's connector). With mp=0 and the uni executor this process is the whole engine;
                   spawned processes do not get it
    barrier        {"dir": D, "passes": [n, ...]}: before pass n (after its reset) write D/before-pass-<n>
                   and wait (at most "timeout_s", default 120) for D/go-pass-<n>: the test acts meanwhile
                   (e.g. restarts the Mooncake master); "before_reset": true puts the wait before that
                   pass's reset (e.g. the test writes a new weights version the reset must pick up)

Result (last stdout line, prefixed `ENGINE_RUN_RESULT `): outputs, finish reasons and num_cached_tokens per
pass (and vLLM's counters after it), every rank's `emu_stats` (with the KV cache groups vLLM planned),
`disable_hybrid_kv_cache_manager` as vLLM resolved it, vLLM's prefix-cache counters, whether
reset_prefix_cache() succeeded after the run (vLLM's own "every block is free" test: no leaked block), with
mp=0 the scheduler's block pool and connector pins (also after shutdown: `engine_after_shutdown`), the
Mooncake server processes the engine's own processes started (`engine_mooncake`, sampled after start-up and
before shutdown), the embedded rendezvous files (`rendezvous`), and the engine's processes (this driver's
session) with the loopback ports each is connected to (`session`, before shutdown).
Environment defaults for a CPU-only machine are set here before vLLM is imported (see the module's
`_ENV`); spawned worker processes find `testbed` and `connector` through PYTHONPATH.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

PROJECT_ROOT = str(Path(__file__).resolve().parent.parent)
RESULT_PREFIX = "ENGINE_RUN_RESULT "
WORKER_CLS = "testbed.emu_worker.EmuWorker"
PROBE_CLS = "testbed.real_worker.ConnectorProbe"
REAL_MODELS = Path(__file__).resolve().parent / "real_models"

_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",  # else UnspecifiedPlatform on a machine without a GPU
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # TP>1 otherwise asserts on NUMA nodes
    "VLLM_HOST_IP": "127.0.0.1",  # the executor's queues advertise loopback, not a LAN address
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}


def _setup_env(mp: int) -> None:
    for k, v in _ENV.items():
        os.environ.setdefault(k, v)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = str(mp)
    paths = [PROJECT_ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    os.environ["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    if PROJECT_ROOT not in sys.path:
        sys.path.insert(0, PROJECT_ROOT)


def copy_real_model(name: str, workdir: str) -> str:
    """A shipped real-model config (by name) or a directory with a config.json, copied into `workdir`: the
    copy's path is the engine's model path, so two runs never share keys."""
    src = REAL_MODELS / name if (REAL_MODELS / name / "config.json").is_file() else Path(name)
    if not (src / "config.json").is_file():
        raise ValueError(f"engine spec real_model={name!r}: no shipped config of that name "
                         f"({sorted(p.name for p in REAL_MODELS.iterdir())}) and no config.json in that directory")
    dst = Path(workdir, src.name)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_bytes((src / "config.json").read_bytes())
    return str(dst)


def _reset_prefix_cache(llm: Any, mp: int, timeout_s: float, reset_connector: bool = False) -> dict[str, Any]:
    """reset_prefix_cache() fails while any block is held (store jobs pin blocks until every rank has
    reported them). mp=1: EngineCore's loop keeps stepping while the connector has pending push work;
    mp=0: nothing steps unless we do."""
    t0 = time.monotonic()
    tries = 0
    while True:
        tries += 1
        if llm.reset_prefix_cache(reset_connector=True) if reset_connector else llm.reset_prefix_cache():
            return {"done": True, "tries": tries, "seconds": round(time.monotonic() - t0, 3)}
        if time.monotonic() - t0 > timeout_s:
            return {"done": False, "tries": tries, "seconds": round(time.monotonic() - t0, 3)}
        if mp:
            time.sleep(0.05)
        else:
            llm.llm_engine.step()
            time.sleep(0.002)  # only the connector's threads can progress: let them


def _metrics(llm: Any) -> dict[str, float]:
    want = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:external_prefix_cache_queries",
            "vllm:external_prefix_cache_hits", "vllm:num_preemptions",
            # the connector's own counters (Prometheus drops a counter's "_total" suffix from its name)
            "vllm:kvledger_deferrals", "vllm:kvledger_saves_dropped", "vllm:kvledger_expired_kept_blocks",
            "vllm:kvledger_held_requests")
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name in want:
            out[m.name.removeprefix("vllm:")] = out.get(m.name.removeprefix("vllm:"), 0) + float(m.value)
    return out


def _rendezvous_files() -> list[dict[str, Any]]:
    from kvledger_connector.store import rendezvous
    d = rendezvous.runtime_dir()
    out = []
    for name in sorted(os.listdir(d)):
        if name.startswith("embedded-") and name.endswith(".json"):
            try:
                out.append({"name": name, **json.loads(Path(d, name).read_text())})
            except (OSError, ValueError):
                out.append({"name": name})
    return out


def _barrier(spec: dict[str, Any], n: int) -> dict[str, Any] | None:
    b = spec.get("barrier")
    if not b or n not in b.get("passes", ()):
        return None
    d = Path(b["dir"])
    t0 = time.monotonic()
    (d / f"before-pass-{n}").write_text(str(os.getpid()))
    go = d / f"go-pass-{n}"
    deadline = t0 + float(b.get("timeout_s", 120))
    while not go.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier before pass {n}: no {go} after {b.get('timeout_s', 120)}s")
        time.sleep(0.05)
    return {"waited_s": round(time.monotonic() - t0, 2), "note": go.read_text()}


PROGRESS_PREFIX = "ENGINE_RUN_PROGRESS "


def _generate_fixed_ids(llm: Any, prompts: list[list[int]], sp: Any, *, pass_no: int = 0,
                        progress: bool = False, step_times: list[float] | None = None,
                        stall_timeout_s: float | None = None, id_prefix: str = "",
                        arrival_rate: float | None = None, timeline: dict[str, Any] | None = None
                        ) -> list[Any]:
    """Adds "<id_prefix>req-<i>" itself and steps until every one finished (with no prefix the ids come back
    in the next pass). `progress`: a progress line per finished request; `step_times`: every step's wall
    time appended. `arrival_rate` (requests/s): open loop, request i arrives i / rate seconds after the
    pass starts and is added at the first step boundary from then on (the engine sleeps while nothing runs
    and the next has not arrived); `timeline`: filled with the pass's start ("t0", `time.monotonic()`) and
    per request ("requests", in order) its arrival, first token and finish (seconds after t0) and tokens."""
    engine = llm.llm_engine
    ids = [f"{id_prefix}req-{i}" for i in range(len(prompts))]
    t0 = time.monotonic()
    due = [i / arrival_rate for i in range(len(ids))] if arrival_rate else [0.0] * len(ids)
    first: dict[str, float] = {}
    added = 0

    def admit() -> None:
        nonlocal added
        now = time.monotonic() - t0
        while added < len(ids) and due[added] <= now:
            engine.add_request(ids[added], {"prompt_token_ids": prompts[added]}, sp)
            added += 1

    admit()
    done: dict[str, Any] = {}
    finish: dict[str, float] = {}
    last = time.monotonic()
    while added < len(ids) or engine.has_unfinished_requests():
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, due[added] - (time.monotonic() - t0)))
            admit()
            continue
        if stall_timeout_s and time.monotonic() - last > stall_timeout_s:
            core = getattr(engine.engine_core, "engine_core", None)
            states = None if core is None else {
                rid: (r.status.name, r.num_computed_tokens, r.num_tokens)
                for rid, r in list(core.scheduler.requests.items())[:12]}
            raise RuntimeError(f"pass {pass_no + 1}: no request finished for {stall_timeout_s}s "
                               f"({len(done)}/{len(ids)} done); scheduler's requests (mp=0 only): {states}")
        t = time.perf_counter()
        outs = engine.step()
        if step_times is not None:
            step_times.append(time.perf_counter() - t)
        now = time.monotonic() - t0
        for out in outs:
            if out.request_id not in first and out.outputs and out.outputs[0].token_ids:
                first[out.request_id] = now
            if out.finished:
                done[out.request_id] = out
                finish[out.request_id] = now
                last = time.monotonic()
                if progress:
                    print(f"{PROGRESS_PREFIX}pass {pass_no}: {len(done)}/{len(ids)} requests", flush=True)
        admit()
    missing = [r for r in ids if r not in done]
    if missing:
        raise RuntimeError(f"requests {missing} never finished")
    if timeline is not None:
        timeline["t0"] = t0
        timeline["requests"] = list({"arrival_s": round(due[i], 6), "first_s": round(first.get(r, finish[r]), 6),
                         "finish_s": round(finish[r], 6), "tokens": len(done[r].outputs[0].token_ids)}
                        for i, r in enumerate(ids))
    return [done[r] for r in ids]


def _inproc_state(llm: Any) -> dict[str, Any] | None:
    """mp=0 only: the EngineCore lives in this process; read its block pool and connector directly."""
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    if core is None:
        return None
    sched = core.scheduler
    pool = sched.kv_cache_manager.block_pool
    held = [b.block_id for b in pool.blocks[1:] if b.ref_cnt != 0]
    state: dict[str, Any] = {"num_blocks": pool.num_gpu_blocks, "free_blocks": pool.get_num_free_blocks(),
                             "held_blocks": held[:20]}
    conn = sched.get_kv_connector()
    ss = getattr(conn, "scheduler_side", None)
    if ss is not None:
        state["pinned_jobs"] = list(ss.steps.ledger.inflight_jobs())[:20]
        state["jobs_opened"] = ss.steps.ledger.num_jobs_opened
        state["jobs_released"] = ss.steps.ledger.counts.total("jobs_released")
        state["load_pins"] = ss.steps.num_load_pins
    return state


def _preload(names: list[str]) -> dict[str, Any]:
    """Each "module:function" called; its return value recorded (`preloaded` in the result)."""
    import importlib
    done: dict[str, Any] = {}
    for name in names:
        mod, _, fn = name.partition(":")
        done[name] = getattr(importlib.import_module(mod), fn)()
    return done


def run(spec: dict[str, Any]) -> dict[str, Any]:
    mp = int(spec.get("mp", 0))
    _setup_env(mp)
    fixed_ids = spec.get("request_ids") in ("fixed", "per_pass")
    per_pass = spec.get("request_ids") == "per_pass"
    if fixed_ids:
        os.environ["VLLM_DISABLE_REQUEST_ID_RANDOMIZATION"] = "1"
    preloaded = _preload(spec.get("preload") or ())
    t0 = time.monotonic()
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from testbed.emu_model import write_jamba_dir, write_model_dir
    from testbed.procs import mooncake_servers_started_by_session, session_processes

    tp = int(spec.get("tp", 1))
    real = spec.get("real_model")
    kind = spec.get("kv_kind", "per_rank")
    if kind not in ("per_rank", "replicated", "mla"):
        raise ValueError(f"engine spec kv_kind={kind!r}: must be 'per_rank', 'replicated' or 'mla'")
    window = spec.get("sliding_window")
    if real:
        model_dir = copy_real_model(str(real), spec["workdir"])
    elif spec.get("mamba"):  # a Jamba-like Mamba hybrid (Mamba in vLLM's "align" mode with prefix caching)
        model_dir = write_jamba_dir(os.path.join(spec["workdir"], "tiny-jamba"),
                                    num_layers=int(spec.get("num_layers", 4)),
                                    num_kv_heads=int(spec.get("num_kv_heads", 2)),
                                    head_size=int(spec.get("head_size", 8)))
    else:
        model_dir = write_model_dir(os.path.join(spec["workdir"], "tiny-llama"),
                                    num_layers=int(spec.get("num_layers", 2)),
                                    num_kv_heads=int(spec.get("num_kv_heads", 2)) if kind == "per_rank" else 1,
                                    num_attention_heads=None if kind == "per_rank" else 2 * tp,
                                    head_size=int(spec.get("head_size", 8)), mla=kind == "mla",
                                    sliding_window=None if window is None else int(window),
                                    full_every=int(spec.get("full_every", 2)))
    kvt = None
    conn = spec.get("connector")
    if conn is not None:
        kvt = KVTransferConfig(kv_connector=conn.get("name", "KVLedgerConnector"),
                               kv_connector_module_path=conn.get("module_path", "kvledger_connector.connector"),
                               kv_role=conn.get("role", "kv_both"),
                               kv_load_failure_policy=conn.get("policy", "recompute"),
                               kv_connector_extra_config=dict(conn.get("extra", {})))
    if real:  # vLLM's own CPU worker runs the model; the probe only adds a named RPC
        model_kw: dict[str, Any] = {
            "load_format": "dummy", "dtype": spec.get("dtype", "bfloat16"), "worker_extension_cls": PROBE_CLS,
            "kv_cache_memory_bytes": int(spec.get("kv_cache_bytes", 64 << 20))}
        if spec.get("num_blocks"):
            model_kw["num_gpu_blocks_override"] = int(spec["num_blocks"])
    else:
        model_kw = {"dtype": "float32", "worker_cls": spec.get("worker_cls", WORKER_CLS),
                    "num_gpu_blocks_override": int(spec.get("num_blocks", 64))}
    llm = LLM(model=model_dir, skip_tokenizer_init=True, seed=0, enforce_eager=True, tensor_parallel_size=tp,
              distributed_executor_backend=spec.get("backend") or ("uni" if tp == 1 else "mp"),
              block_size=int(spec.get("block_size", 32 if real else 16)), enable_prefix_caching=True,
              prefix_caching_hash_algo="sha256",
              max_model_len=int(spec.get("max_model_len", 256)), max_num_seqs=int(spec.get("max_num_seqs", 8)),
              max_num_batched_tokens=int(spec.get("max_num_batched_tokens", 128)),
              kv_transfer_config=kvt, disable_log_stats=False, **model_kw)
    result: dict[str, Any] = {"startup_s": round(time.monotonic() - t0, 1), "passes": [], "driver_pid": os.getpid(),
                              "preloaded": preloaded,
                              "engine_mooncake": {"startup": mooncake_servers_started_by_session(os.getsid(0))},
                              "rendezvous": {"startup": _rendezvous_files()}}
    # vLLM's CPU platform turns async scheduling off (platforms/cpu.py); recorded, not chosen
    result["async_scheduling"] = bool(llm.llm_engine.vllm_config.scheduler_config.async_scheduling)
    # resolved in VllmConfig.__post_init__ (platform, connector's SupportsHMA); EngineCore gets this config
    result["disable_hybrid_kv_cache_manager"] = bool(
        llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager)
    prompts: list[list[int]] = [list(map(int, p)) for p in spec["prompts"]]
    max_tokens = int(spec.get("max_tokens", 8))
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, temperature=0.0)
    settle_s = float(spec.get("settle_timeout_s", 60))
    warmup = [list(map(int, p)) for p in spec.get("warmup_prompts") or ()]
    if warmup:
        t1 = time.monotonic()
        if fixed_ids:
            _generate_fixed_ids(llm, warmup, sp, pass_no=-1, id_prefix="w-")
        else:
            llm.generate([{"prompt_token_ids": p} for p in warmup], sp, use_tqdm=False)
        result["warmup"] = {"seconds": round(time.monotonic() - t1, 2),
                            "reset": _reset_prefix_cache(llm, mp, settle_s)}
    for n in range(int(spec.get("passes", 2))):
        entry: dict[str, Any] = {}
        early = bool((spec.get("barrier") or {}).get("before_reset"))
        if early and (waited := _barrier(spec, n)) is not None:
            entry["barrier"] = waited
        if n > 0 and spec.get("reset_between_passes", True):
            entry["reset"] = _reset_prefix_cache(llm, mp, settle_s, n in (spec.get("reset_connector") or ()))
        if not early and (waited := _barrier(spec, n)) is not None:
            entry["barrier"] = waited
        t1 = time.monotonic()
        if fixed_ids:
            steps: list[float] | None = [] if spec.get("step_times") else None
            timeline: dict[str, Any] = {}
            outs = _generate_fixed_ids(llm, prompts, sp, pass_no=n, progress=bool(spec.get("progress")),
                                       step_times=steps, stall_timeout_s=spec.get("stall_timeout_s"),
                                       id_prefix=f"p{n}-" if per_pass else "",
                                       arrival_rate=spec.get("arrival_rate"), timeline=timeline)
            entry["timeline"] = timeline
            if steps:
                ordered = sorted(steps)
                entry["steps"] = len(steps)
                entry["step_s"] = {"sum": sum(steps), "mean": sum(steps) / len(steps),
                                   "median": ordered[len(ordered) // 2],
                                   "p90": ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]}
        else:
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        entry["seconds"] = round(time.monotonic() - t1, 2)
        entry["request_ids"] = [o.request_id for o in outs]
        entry["outputs"] = [list(o.outputs[0].token_ids) for o in outs]
        entry["finish_reasons"] = [str(o.outputs[0].finish_reason) for o in outs]
        entry["num_cached_tokens"] = [o.num_cached_tokens for o in outs]
        entry["metrics"] = _metrics(llm)
        result["passes"].append(entry)
    result["at_rest"] = _reset_prefix_cache(llm, mp, settle_s)  # vLLM's "no block held" test
    result["workers"] = llm.collective_rpc("connector_probe" if real else "emu_stats")
    result["metrics"] = _metrics(llm)
    result["engine"] = _inproc_state(llm)
    result["engine_mooncake"]["end"] = mooncake_servers_started_by_session(os.getsid(0))
    result["rendezvous"]["end"] = _rendezvous_files()
    result["session"] = session_processes(os.getsid(0))  # the engine's processes and their connections
    t2 = time.monotonic()
    # workers shut their connectors down, then EngineCore its scheduler-side one (trace files closed);
    # a timeout longer than vLLM's 5 s worker grace lets EngineCore get that far when workers hang
    llm.llm_engine.engine_core.shutdown(**({"timeout": float(spec["shutdown_timeout_s"])}
                                           if spec.get("shutdown_timeout_s") else {}))
    result["shutdown_s"] = round(time.monotonic() - t2, 1)
    result["engine_after_shutdown"] = _inproc_state(llm)  # mp=0: the scheduler-side ledger after shutdown
    result["total_s"] = round(time.monotonic() - t0, 1)
    return result


def main(argv: list[str] | None = None) -> int:
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>`: every thread's stack, to stderr
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    text = Path(args[0]).read_text() if not args[0].lstrip().startswith("{") else args[0]
    result = run(json.loads(text))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
