"""The connector's old module path, kept so configs written before the rename keep working:
``kv_connector_module_path: "connector.connector"`` from a checkout. The code lives in ``kvledger_connector``;
this package is not installed (only ``kvledger`` and ``kvledger_connector`` are)."""
