"""The store: its contract (`contract`: result codes and the `KVStore` protocol), the Mooncake client
(`client`) with its breaker (`breaker`), master authenticity check (`authenticity`) and disk tier directories
(`tier`), the embedded master and its supervisor (`embedded`), the rendezvous between an engine's processes,
the worker's store calls (`io`), the scheduler's bounded calls (`deadline`) and the transfer-port firewall
recipe."""
