"""Diagnose a deployment's tokens/s, recommend its speculation settings, and plan its context length.

``eyas diagnose [diagnose=<preset>] diagnose.key=value ...``  measure, explain, recommend (this package)
``eyas plan plan.model=kimi_k2 plan.gpu_mem_gib=141 ...``       memory plan (``eval.plan``)

Presets are the Hydra group ``conf/diagnose/`` (``default``: a few minutes on the embedded target; ``smoke``;
``gpu``). A run writes ``report.md``, ``results.json`` and plots to ``diagnose.out_dir`` and exits with status 1 when a
cell is flagged, so CI can gate a serving change on it.

At batch 1, tokens/s = τ ÷ (draft + verify + bookkeeping) (``eval.throughput``). Diagnose checks that
decomposition on the real loop and reports which term a slow deployment is paying for:

1. In each *round*, at each context length L, generate every prompt of every set with every method at contexts
   of about L tokens, and take a profile sample (``eval.profile.StepProfiler``: the target's verify forward for
   every width the settings use, the drafter's forwards, the loop's bookkeeping) before the first generation and
   after each one; the model-free proposers' search (prompt lookup) is timed once per round and L.
2. Per (method, prompt set, L): τ and acceptance per draft position are counted from the steps; the predicted
   tokens/s prices each generation's steps with the two samples that bracket it (never with the steps' own
   timings); the measured tokens/s is wall clock after prefill. The spread of the per-generation
   predicted/measured ratios is the noise, and a cell whose ratio is farther from 1 than
   ``max(tolerance, n_sigma × standard error)`` is flagged as a likely bug (work the loop does that the profile
   does not, or the reverse).
3. Per cell, chains K = 0..k_max are priced from the measured per-position acceptance and step-time curves,
   next to the levers: a better drafter (acceptance + δ), a cheaper verify, a cheaper drafter, the ceiling.

Design decisions:
- Profile samples are interleaved with the generations they price, so a machine shared with other jobs (or a
  GPU changing clocks) loads both sides of the comparison alike; what still differs is the noise estimate.
- Contexts of about L tokens are built by putting earlier turns of a real chat corpus (``filler``, ShareGPT by
  default) before each prompt, through the target's chat template, the last filler answer cut to fit; the
  actual mean context of the steps is what gets priced and reported.
- "Predictable" prompts: ``builtin:predictable`` (copy a HumanEval function verbatim, count, write a times
  table). Their answers are fixed by the prompt or by a trivial rule, so any competent drafter (and prompt
  lookup, for the copies) predicts most tokens: the high-τ end of the spectrum (τ 7–8 is within reach there). "Hard
  reasoning" is reasoning-gym's held-out seeds: each answer depends on arithmetic the drafter must redo.
- Drafters: an exported checkpoint (SGLang or speculators format), a trainer checkpoint, ``auto`` (the newest
  under ``runs/``) or ``random`` (an untrained EAGLE-3 drafter: τ ≈ 1, which still tests the arithmetic).
- The results never depend on the output directory: ``results.json`` holds every number ``report.md`` and the
  plots show.


Modules: ``config`` (settings, presets), ``contexts`` (prompts at a context length), ``measure``
(generations and profile samples), ``analysis`` (predicted against measured, recommendations), ``run`` (the
whole diagnosis), ``report`` (markdown, JSON, plots), ``__main__`` (the Hydra app). Loading the drafter is
``serving.drafters``.
"""

from eyas.eval.diagnose.analysis import (  # noqa: F401
    CellRecommendation,
    CellResult,
    DiagnoseResult,
    analyse,
    combine,
    predict_steps,
    recommend,
)
from eyas.eval.diagnose.config import (  # noqa: F401
    CONF_DIR,
    METHODS,
    DiagnoseConfig,
    DiagnoseError,
    drafter_kind,
    method_specs,
)
from eyas.eval.diagnose.context_prompts import (  # noqa: F401
    ContextPrompts,
    build_prompts,
    filler_pairs,
    pad_to_context,
    prompts_from_ids,
)
from eyas.eval.diagnose.measure import (  # noqa: F401
    Generation,
    Measurements,
    check_contexts,
    costs_from_samples,
    measure,
    profile_config,
    time_propose,
)
from eyas.eval.diagnose.report import (  # noqa: F401
    decomposition_markdown,
    decomposition_rows,
    measured_breakdown_markdown,
    print_summary,
    recommendation_markdown,
    step_profile,
    write_report,
)
from eyas.eval.diagnose.run import (  # noqa: F401
    diagnose,
    target_facts,
)
from eyas.serving.load import (  # noqa: F401 (drafter loading moved to serving)
    LoadedDrafter,
    find_drafter,
    load_drafter,
    random_drafter,
)
