"""The prepared GPU check packs and passes here on CPU (GPU_CHECK_DEVICE=cpu): the folder it ships is
self-contained (no vLLM, no project import beyond kvledger_connector/shape/kvlayout.py and tagkernel.py,
shipped flat) and its checks hold on CPU memory."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_packs_and_passes_on_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "GPU_CHECK_DIR": str(tmp_path / "pack"), "GPU_CHECK_DEVICE": "cpu",
           "PYTHON": sys.executable}
    subprocess.run(["scripts/gpu-check.sh", "pack"], cwd=ROOT, env=env, check=True, timeout=300)
    shipped = sorted(p.name for p in (tmp_path / "pack").iterdir())
    assert set(shipped) == {"kvlayout.py", "tagkernel.py", "test_gpu_kv.py", "geometry.json", "record.log", "kvledger"}
    assert sorted(p.name for p in (tmp_path / "pack" / "kvledger").iterdir()) == ["errors.py"]
    # the pack must not reach back into the project: run it from a copy's own folder with no PYTHONPATH
    env.pop("PYTHONPATH", None)
    res = subprocess.run(["scripts/gpu-check.sh", "run"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=540)
    last = res.stdout.strip().splitlines()[-1]
    assert res.returncode == 0 and last.startswith("GPU-CHECK PASS on cpu"), res.stdout[-2000:]
