"""The worker: sync engine, training loop pieces, built-in model and data. Never imports the server."""
