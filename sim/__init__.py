"""The in-process simulator and the data-parallel baseline, built from the worker's and server's pieces."""
