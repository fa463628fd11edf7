"""The tests' tools, not tests: shards and workers as processes (procs.py, through forkserver.py), a shard
in a thread of the test's process (inthread.py), the standard nano shard's settings (nano_shard.py), a
throttling proxy (netproxy.py), a transport with no shard (nowire.py), a tiny Hugging Face GPT-2
(hf_gpt2.py) and Helm's rendering in Python (helm_render.py).

Imported as `tests.support.NAME` (pytest runs from the repository's root, pyproject's `pythonpath`). Nothing
here is collected as a test, and nothing here imports a test file.
"""
