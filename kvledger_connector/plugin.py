"""vLLM plugin: makes ``KVLedgerConnector`` a connector name vLLM's KV connector factory knows.

Installed as the ``vllm.general_plugins`` entry point ``kvledger`` (pyproject.toml). vLLM calls every
general plugin in each of its processes (the API process, the EngineCore, each worker) before it builds a
connector, and may call a plugin more than once in one process, so `register` is idempotent. With it,

    --kv-transfer-config '{"kv_connector": "KVLedgerConnector", "kv_role": "kv_both"}'

needs no ``kv_connector_module_path``. A config that still names a module path (``kvledger_connector.connector``,
or ``connector.connector`` from a checkout) is resolved by the path first, as vLLM always does.

The plugin also seeds ``KVLEDGER_RUNTIME_TOKEN`` (random, unless already set) in the first vLLM process, before
it spawns the EngineCore and the workers, which inherit it: the secret part of the embedded store's runtime
directory name (kvledger_connector/store/rendezvous.py), so no other user can create that directory first.

Registration is lazy: vLLM's factory stores the module path and imports the connector (torch, Mooncake) only
when a config names it, so a process that never uses the connector pays only for importing the factory.
"""
from __future__ import annotations

import os
import secrets

#: the name configs use (``kv_connector``), the module and the class vLLM imports for it
CONNECTOR_NAME = "KVLedgerConnector"
MODULE_PATH = "kvledger_connector.connector"
CLASS_NAME = "KVLedgerConnector"
#: rendezvous.RUNTIME_TOKEN_ENV (not imported: this module stays light)
RUNTIME_TOKEN_ENV = "KVLEDGER_RUNTIME_TOKEN"


def register() -> None:
    """Register `CONNECTOR_NAME` with vLLM's `KVConnectorFactory`; a no-op when the name is already known
    (a second call, or vLLM shipping a connector of that name: the first registration wins, as in vLLM)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    os.environ.setdefault(RUNTIME_TOKEN_ENV, secrets.token_hex(16))
    if is_registered():
        return
    try:
        KVConnectorFactory.register_connector(CONNECTOR_NAME, MODULE_PATH, CLASS_NAME)
    except ValueError as e:
        # vLLM refuses a second registration of a name ("... is already registered."): another thread or
        # plugin registered it between the check and here. Anything else is a real error.
        if not (is_registered() or "already registered" in str(e)):
            raise


def is_registered() -> bool:
    """Whether vLLM's factory resolves `CONNECTOR_NAME` by name (without importing the connector)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict):
        return CONNECTOR_NAME in registry
    return False  # a vLLM without the private registry dict: register() relies on its ValueError instead
