"""``python -m kvledger_connector.config``: render the config tables (docs.py)."""
import sys

from kvledger_connector.config.docs import main

raise SystemExit(main(sys.argv[1:]))
