"""The parameter-server shard: state and aggregation (pure), and, with the gRPC issue, its servicer.
Never imports the worker."""
