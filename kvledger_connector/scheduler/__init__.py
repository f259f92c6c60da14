"""The scheduler side: the steps that decide (`steps`), the vLLM-facing side that holds them
(`side`), and the prefix-cache resets' store removals (`reset`)."""
