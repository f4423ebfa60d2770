"""Where the engine keeps tokens' KV and recurrent state: the two pools (`kv_pool.py`,
`state_pool.py`), their sizing (`pool_sizing.py`), each slot's page list on the device
(`page_table.py`), and prefix caching: the radix tree of pages and state snapshots
(`radix_cache.py`, `radix_node.py`, `cache_policy.py`) and the engine's adapter to it
(`adapter.py`).
"""
