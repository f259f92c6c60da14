"""The generic conformance engine: nothing here knows the KV ledger.

`tlc` runs TLC and parses its values and messages; `export` dumps a model's state graph as behaviours;
`replay` walks one behaviour through a driver; `fuzz` is the oracle that checks a driver's random runs
against the exported graph; `tracecheck` turns an event log into a TLA+ trace spec and asks TLC to
accept it. The KV-specific parts (the driver, log normalizers, mutants, model-check table, witnesses,
`make verify`'s orchestrator) live one level up in `conformance/`.
"""
