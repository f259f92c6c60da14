"""The package as a user installs it: a wheel built from this tree, installed with ``--no-deps`` into a fresh
venv, used from a directory outside the checkout with no PYTHONPATH. vLLM must find the connector by name
through the plugin entry point (no ``kv_connector_module_path``), and the old module path must still work
from a checkout.

The fresh venv reuses the test interpreter's installed dependencies (vLLM, torch, Mooncake) through a .pth
file: the machine has no index to install them from, and they are not what is under test. The checkout is
on neither path, so the only kvledger the subprocess can import is the installed wheel.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import torch

from kvledger_connector.connector import KVLedgerConnector

ROOT = Path(__file__).resolve().parents[2]
#: what a wheel is built from (pyproject.toml names the packages; spec/ holds kvledger's machines.json)
SOURCES = ("pyproject.toml", "README.md", "kvledger", "kvledger_connector", "spec")

CHECK = textwrap.dedent("""
    import json, sys
    out = {}
    import kvledger_connector, kvledger.machines
    out["connector_file"] = kvledger_connector.__file__
    out["spec_path"] = str(kvledger.machines.SPEC_PATH)
    try:
        import connector.connector  # the checkout-only shim must not be installed
        out["shim"] = connector.__file__
    except ModuleNotFoundError:
        out["shim"] = None
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    out["registered_before_plugins"] = "KVLedgerConnector" in KVConnectorFactory._registry
    from vllm.plugins import load_general_plugins
    load_general_plugins()
    import kvledger_connector.plugin as plugin
    plugin.register()  # vLLM may load a plugin again in one process: a second call is a no-op
    out["registered"] = plugin.is_registered()
    # lazy: registering imports neither the connector nor Mooncake (vLLM imports them when a config names it)
    out["lazy"] = "kvledger_connector.connector" not in sys.modules and "mooncake.store" not in sys.modules
    # the CLI path: --kv-transfer-config JSON with a name and a role only, parsed by vLLM's own argument parser
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    args = EngineArgs.add_cli_args(FlexibleArgumentParser()).parse_args(
        ["--kv-transfer-config", '{"kv_connector": "KVLedgerConnector", "kv_role": "kv_both"}'])
    ktc = args.kv_transfer_config
    from vllm.config import KVTransferConfig, VllmConfig
    vc = VllmConfig(kv_transfer_config=KVTransferConfig(kv_connector="KVLedgerConnector", kv_role="kv_both"))
    cls_cli = KVConnectorFactory.get_connector_class(ktc)
    cls_cfg = KVConnectorFactory.get_connector_class(vc.kv_transfer_config)
    out["cli_module_path"] = ktc.kv_connector_module_path
    out["cli_class"] = f"{cls_cli.__module__}.{cls_cli.__qualname__}"
    out["cfg_class"] = f"{cls_cfg.__module__}.{cls_cfg.__qualname__}"
    out["class_file"] = sys.modules[cls_cfg.__module__].__file__
    out["same_class"] = cls_cli is cls_cfg
    # vLLM's metrics path resolves the connector class by name too
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorLogging
    out["logging_class"] = KVConnectorLogging(vc.kv_transfer_config).connector_cls.__name__
    print("RESULT " + json.dumps(out))
""")


def _run(cmd: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, **kw)  # type: ignore[call-overload]
    if p.returncode != 0:
        raise AssertionError(f"{cmd[:4]}... exited {p.returncode}\nstdout: {p.stdout[-3000:]}\n"
                             f"stderr: {p.stderr[-3000:]}")
    return p


def test_wheel_in_a_fresh_venv_registers_the_connector_by_name(tmp_path: Path) -> None:
    src = tmp_path / "src"  # build from a copy: the build writes build/ and *.egg-info next to its sources
    src.mkdir()
    for name in SOURCES:
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(p, src / name)
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "-q", "-w", str(wheels), str(src)])
    (wheel,) = wheels.glob("kvledger-*.whl")

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    vpy = venv / "bin" / "python"
    site = Path(_run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    # the dependencies come from the test interpreter's site-packages (after the venv's own: the wheel wins)
    deps = sysconfig.get_paths()["purelib"]
    (site / "kvledger-test-deps.pth").write_text(f"import site; site.addsitedir({deps!r})\n")
    _run([sys.executable, "-m", "pip", "--python", str(vpy), "install", "--no-deps", "--no-index", "-q",
          str(wheel)])

    work = tmp_path / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VLLM_PLUGINS", "PYTHONHOME")}
    env["HF_HUB_OFFLINE"] = "1"
    if not torch.cuda.is_available():
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")  # else vLLM cannot infer a device for its configs
    p = _run([str(vpy), "-c", CHECK], cwd=str(work), env=env)
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("RESULT "))
    out = json.loads(line[len("RESULT "):])

    assert Path(out["connector_file"]).is_relative_to(site), out  # the installed package, not the checkout
    assert Path(out["spec_path"]).is_relative_to(site) and Path(out["spec_path"]).name == "machines.json", out
    assert out["shim"] is None, out
    assert out["registered_before_plugins"] is False, out  # the name comes from the plugin, nothing else
    assert out["registered"] and out["lazy"], out
    assert out["cli_module_path"] is None, out
    assert out["cli_class"] == out["cfg_class"] == "kvledger_connector.connector.KVLedgerConnector", out
    assert out["same_class"] and Path(out["class_file"]).is_relative_to(site), out
    assert out["logging_class"] == "KVLedgerConnector", out
    assert str(ROOT) not in p.stdout


def test_old_module_path_still_resolves_from_a_checkout() -> None:
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    for path in ("connector.connector", "kvledger_connector.connector"):
        cfg = KVTransferConfig(kv_connector="KVLedgerConnector", kv_connector_module_path=path, kv_role="kv_both")
        assert KVConnectorFactory.get_connector_class(cfg) is KVLedgerConnector

