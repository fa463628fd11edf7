"""The benchmarks (BENCHMARKS.md has their recorded results): each module runs from the repository's root as
`python -m benchmarks.NAME` (`make bench-NAME`), and harness.py is what they share (processes, the machine,
results). Not part of the installed package: the package never imports anything of this folder."""
