"""The ground floor: config, fragments and schedule, codecs, outer step, fingerprint. Imports neither
server nor worker, does no networking and no file I/O."""
