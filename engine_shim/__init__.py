"""A vLLM 0.33 engine without a GPU: faithful block pool and KV events, OpenAI HTTP API.

Layers, each usable alone: request / block_pool / kv_cache_manager (pure prefix-cache
logic, replays vLLM's own trace), scheduler (steps, budget, preemption), backend (the model
step: simulated by default), engine (asyncio loop per DP rank), server + runner (HTTP),
cli (``engine-shim``). Nothing heavy is imported here, so ``import engine_shim.x`` stays cheap.
"""
