"""The child process of :func:`data.corpora.sources.reasoning_gym_tasks`: generates reasoning-gym items under the
fixed hash seed its parent starts it with. Reads ``{"tasks": [...], "base": int, "size": int}`` as JSON on stdin,
writes a JSON list (one list of ``[question, answer]`` per task) on stdout."""

from __future__ import annotations

import json
import sys
import warnings


def main() -> None:
    from eyas.data.corpora.sources import (
        REASONING_GYM_HASH_SEED,
        generate_reasoning_gym_here,
        runs_under_fixed_hash_seed,
    )

    if not runs_under_fixed_hash_seed():
        sys.exit(
            f"run with PYTHONHASHSEED={REASONING_GYM_HASH_SEED} (the items would depend on the hash seed)"
        )
    req = json.loads(sys.stdin.read())
    warnings.filterwarnings("ignore")  # a generator's warnings would not reach the user from here
    out = generate_reasoning_gym_here(list(req["tasks"]), int(req["base"]), int(req["size"]))
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
