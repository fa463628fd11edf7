"""The shard's round logic, pure: the shard's rounds (state.py, ShardState), one fragment's slice with its
master, optimizer and open round (fragment.py), the records and jobs that fold and close them (jobs.py),
who the rounds wait for (members.py), when a round closes (rule.py), pushes while they arrive (staging.py),
the robust checks and rules (defenses.py, robust.py), and what a checkpoint keeps of a fragment
(records.py).

Nothing here does networking, file I/O or asyncio: numbers and tensors in, decisions out, the clock passed
in. The simulator runs the same code. tests/test_structure.py holds that line.
"""
