"""The AMK version, importable without the amk package's side effects (the backends key their
caches on it)."""
VERSION = "0.1.0"
