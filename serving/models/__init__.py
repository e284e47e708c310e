"""The model layer: the target runner, the EAGLE-3 drafter, KV caches, TTT and row-exact attention, the embedded and
tiny models. The trainer, extraction and the speculative loop all stand on it; it imports nothing from eyas above
it except :mod:`eyas.common`."""
