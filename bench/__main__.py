"""make bench: every benchmark of the project, each printing ratios against a baseline measured in the
same run (these machines are noisy, so only same-run ratios mean anything)."""
import importlib
import sys

SUITES = ("bench.ledger", "bench.metadata", "bench.connector", "bench.datapath", "bench.engine",
          "bench.scheduler", "bench.outage", "bench.replicas", "bench.hybrid",
          "bench.tpshared", "bench.tier", "bench.tier_harness", "bench.tier_promotion", "bench.real")
# arguments of a suite's main() here (its own command's defaults measure more)
ARGS = {"bench.real": ["--rounds", "1", "--workloads", "prefill,light,open-low"]}


def main() -> int:
    rc = 0
    for name in SUITES:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if e.name == name:
                print(f"[bench] {name}: not present, skipped")
                continue
            raise
        print(f"\n===== {name} =====", flush=True)
        rc |= int((mod.main(ARGS[name]) if name in ARGS else mod.main()) or 0)
    return rc


if __name__ == "__main__":
    sys.exit(main())
