"""The ground floor: config, fragments and schedule, codecs, outer step, fingerprint. Imports neither
server nor worker and does no networking; its file I/O is reading the files it is given (statefile, tls)
and atomic.py, the one way the package writes a file in place of another."""
