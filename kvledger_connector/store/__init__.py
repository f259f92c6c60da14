"""The store: the Mooncake client and its breaker (`client`), the embedded master and its supervisor
(`embedded`), the rendezvous between an engine's processes, the store-call wrapper (`deadline`)
and the transfer-port firewall recipe."""
