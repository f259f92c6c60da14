"""The block shape: key layouts and builders, vLLM's engine facts, the KV views' copy plans and the
integrity tags over them."""
