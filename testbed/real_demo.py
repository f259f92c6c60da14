"""`make demo`: the connector under a real model, on a machine without a GPU, in one command.

vLLM's CPU build runs a real architecture (a shipped config from testbed/real_models, random weights:
`load_format="dummy"`, no download) through its own engine, CPU worker and attention kernels. Two engines
run the same prompts, which share prefixes, greedy:

1. without a connector, one pass: the reference outputs;
2. with `"kv_connector": "KVLedgerConnector"` and nothing else (the embedded default: the engine starts a
   private Mooncake master on 127.0.0.1), two passes with `reset_prefix_cache()` between them, so pass 2
   finds nothing in vLLM's own cache and every prefix hit is the store's.

It prints, per prompt, the tokens pass 2 took from the cache and whether both passes' outputs equal the
reference, token for token. Exit 1 when an output differs or pass 2 took nothing from the store.

    python -m testbed.real_demo [--model llama-gqa] [--tp 1] [--requests 8] [--timeout 300]
"""
from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from testbed.engine_demo import run_engine
from testbed.engine_run import REAL_MODELS

PREFIX_BLOCKS = 5
BLOCK = 32


def _prompts(n: int, num_prefixes: int = 2, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    pre = [[rng.randrange(10, 1000) for _ in range(PREFIX_BLOCKS * BLOCK)] for _ in range(num_prefixes)]
    return [pre[i % num_prefixes] + [rng.randrange(10, 1000) for _ in range(rng.randrange(8, 48))] for i in range(n)]


def _spec(workdir: str, model: str, tp: int, prompts: list[list[int]], connector: dict[str, Any] | None,
          passes: int) -> dict[str, Any]:
    return {"workdir": workdir, "real_model": model, "prompts": prompts, "max_tokens": 16, "passes": passes,
            "tp": tp, "mp": 1 if tp > 1 else 0, "backend": "mp" if tp > 1 else "uni", "max_model_len": 1024,
            "max_num_batched_tokens": 256, "connector": connector, "reset_between_passes": True}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-gqa", help=f"a shipped config: {sorted(p.name for p in REAL_MODELS.iterdir())}")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=300)
    a = ap.parse_args(argv)
    prompts = _prompts(a.requests)
    env = {"VLLM_LOGGING_LEVEL": "WARNING"}
    with tempfile.TemporaryDirectory(prefix="kvledger-demo-") as tmp:
        print(f"{a.model} (random weights, bf16), TP {a.tp}, {len(prompts)} prompts on 2 shared prefixes of "
              f"{PREFIX_BLOCKS * BLOCK} tokens")
        t0 = time.monotonic()
        print("1. without a connector (the reference) ...", flush=True)
        ref = run_engine(_spec(str(Path(tmp, "ref")), a.model, a.tp, prompts, None, 1), env=env,
                         log=Path(tmp, "ref.log"), timeout_s=a.timeout)
        print('2. "kv_connector": "KVLedgerConnector" (embedded default), two passes ...', flush=True)
        conn = {"policy": "recompute", "module_path": None, "extra": {}}
        ours = run_engine(_spec(str(Path(tmp, "ours")), a.model, a.tp, prompts, conn, 2), env=env,
                          log=Path(tmp, "ours.log"), timeout_s=a.timeout)
        if ref is None or ours is None:
            return 1
        want = ref["passes"][0]["outputs"]
        p1, p2 = ours["passes"]
        print(f"\n{'prompt':>6} {'tokens':>6} {'pass 1 cached':>13} {'pass 2 cached':>13}  outputs equal (pass 1, pass 2)")
        ok = True
        for i, p in enumerate(prompts):
            same = (p1["outputs"][i] == want[i], p2["outputs"][i] == want[i])
            ok &= all(same)
            print(f"{i:>6} {len(p):>6} {p1['num_cached_tokens'][i]:>13} {p2['num_cached_tokens'][i]:>13}  "
                  f"{'yes' if same[0] else 'NO'}, {'yes' if same[1] else 'NO'}")
        from_store = ours["metrics"].get("external_prefix_cache_hits", 0)
        served = all(c >= PREFIX_BLOCKS * BLOCK for c in p2["num_cached_tokens"])
        print(f"\npass 2 took {int(from_store)} tokens from the store; every prompt served from its prefix on: "
              f"{'yes' if served else 'NO'}; every output equal to the reference: {'yes' if ok else 'NO'} "
              f"({time.monotonic() - t0:.0f} s)")
        return 0 if ok and served and from_store > 0 else 1


if __name__ == "__main__":
    sys.exit(main())
