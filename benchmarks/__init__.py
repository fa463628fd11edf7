"""The benchmarks (BENCHMARKS.md has their recorded results): each module runs from the repository's root as
`python -m benchmarks.NAME` (`make bench-NAME`; the larger ones, wire and wan, are packages), and harness/ is
what they share (a run's session, processes, /proc, network namespaces, the machine, results). Not part of
the installed package: the package never imports anything of this folder."""
