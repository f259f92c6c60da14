"""Telemetry: the one counter recorder and its export to vLLM's stats and Prometheus (`stats`),
the KV cache events, and the trace file."""
