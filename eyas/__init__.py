"""eyas: train, prove and ship EAGLE-3 speculative-decoding drafters.

One installed namespace. The four stages keep the repository's top-level folders and install as
subpackages: :mod:`eyas.serving` (the floor: target runner, drafter, loop, export), :mod:`eyas.data`,
:mod:`eyas.train`, :mod:`eyas.eval`; :mod:`eyas.conf` holds the Hydra configs as package data. This package's
own modules are the orchestration above the stages (:mod:`eyas.cli`, :mod:`eyas.pipeline`, the benchmarks).
Importing ``eyas`` imports no stage.
"""

__version__ = "0.1.0"
