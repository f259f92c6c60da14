"""Old module path of the connector (``connector.connector``); see ``kvledger_connector.connector``."""
from kvledger_connector.connector import KVLedgerConnector

__all__ = ["KVLedgerConnector"]
