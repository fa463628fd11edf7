"""What a shard keeps on disk: its checkpoint (checkpoint.py) under a directory lock (dirlock.py), the run's
data-pieces ledger on shard 0 (ledger.py), and the contribution credits of the workers (credits.py).
"""
