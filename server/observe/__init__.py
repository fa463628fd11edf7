"""What a shard shows: its status as JSON (status.py), the dashboard's bounded time series (dashboard.py),
Prometheus metrics (metrics.py), and the run's view over every shard (run_view.py).
"""
