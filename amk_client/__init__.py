"""The torch-free side of `amk serve`: the `amk` console entry point, which hands `amk generate`
to a running warm server over a Unix socket and imports amk (and torch) only when it must run
in-process. Stdlib only: importing anything under `amk` runs amk/__init__, which imports torch."""
