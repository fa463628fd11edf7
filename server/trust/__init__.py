"""Trust and limits: the credentials a shard accepts and the identity each proves (auth.py), the session
ids Join hands out (membership.py), who is on the shard (roster.py), and the bounds on everything a client
can make the shard hold (bounds.py).
"""
