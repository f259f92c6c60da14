"""Every bad input is a `LedgerInputError` naming its field and value: the configuration's (`ConfigError`) and
the KV cache's (`KVLayoutError`) too, each keeping its own wording."""
from __future__ import annotations

from kvledger.errors import LedgerInputError
from kvledger_connector.config import ConfigError
from kvledger_connector.shape.kvlayout import KVLayoutError


def test_a_config_error_is_an_input_error_naming_source_field_and_value() -> None:
    e = ConfigError("max_inflight_jobs", 0, "must be > 0", "kv_connector_extra_config")
    assert isinstance(e, LedgerInputError)
    assert (e.field, e.value, e.reason) == ("max_inflight_jobs", 0, "must be > 0")
    assert e.source == "kv_connector_extra_config"
    assert str(e) == "kv_connector_extra_config: max_inflight_jobs=0: must be > 0"
    assert str(e.at("environment")) == "environment: max_inflight_jobs=0: must be > 0"


def test_a_kv_layout_error_is_an_input_error_in_its_own_words() -> None:
    e = KVLayoutError("page_bytes=0: must be an int >= 1", "page_bytes", 0)
    assert isinstance(e, LedgerInputError) and (e.field, e.value) == ("page_bytes", 0)
    assert str(e) == "page_bytes=0: must be an int >= 1"
    bare = KVLayoutError("register_kv_caches: no KV cache tensors")
    assert (bare.field, bare.value, str(bare)) == ("kv_cache", None, "register_kv_caches: no KV cache tensors")
    assert str(LedgerInputError("block_ids", [0], "why")) == "block_ids=[0]: why"
