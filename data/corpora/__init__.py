"""Corpora: named sources of :class:`~data.types.Conversation`, mixtures of them, and evaluation prompt sets.

Design decisions:
- A source is a small typed config (:class:`SourceConfig`) of one *kind*: ``sharegpt`` (the packaged ShareGPT
  dump), ``evals`` (OpenAI evals registry data, packaged), ``reasoning_gym`` (procedural tasks), ``mt_bench`` and
  ``humaneval`` (packaged evaluation prompt sets), ``file`` (local JSONL / JSON array / Parquet, a directory or a
  glob of them) and ``hf`` (anything ``datasets.load_dataset`` reads). Each named config is a YAML file in
  ``conf/corpus/``; a mixture file lists sources (by name, with overrides, or inline) with weights.
- Records may be in the docs/DESIGN.md format (``role``/``content``/``reasoning``) or ShareGPT style
  (``from``/``value``); roles are normalised to system/user/assistant. User files are read strictly: a
  malformed line or record raises an error naming the file and line. The packaged ShareGPT dump is known to be
  messy and is read tolerantly (records that cannot be used are counted per reason, never silently).
- JSON-array dumps are streamed record by record (:class:`JsonArrayStream`, ``raw_decode`` over a buffered
  read), so a dump cut off mid-record (the packaged ShareGPT file is) or damaged in the middle still yields
  every complete record; where and how much was lost is logged and returned in the stats.
- Splits are deterministic: a record goes to the eval split when a hash of (seed, id) falls below
  ``eval_fraction``, so the split does not depend on file order or on the budget. Budgets are filled with the
  records of smallest hash (bottom-k), a uniform sample that needs one streaming pass and a heap of the budget.
  Records are deduplicated by id across the whole mixture.
- reasoning-gym items are generated with ``Random(dataset_seed + index)``; train and eval use disjoint seed
  intervals by construction (:func:`reasoning_gym_seed`), so no eval item can be a training item whatever the
  seed and sizes.
- MT-bench and HumanEval are evaluation prompt sets only: a mixture that would train on them raises. The eval
  stage loads any prompt set by name with :func:`load_prompt_set`.


Modules: ``config`` (source and corpus configs), ``readers`` (JSONL / JSON-array / Parquet files),
``records`` (records to conversations), ``sources`` (one reader per kind), ``mixtures`` (splits and budgets),
``prompt_sets`` (evaluation prompt sets by name).
"""

from eyas.data.corpora.config import (  # noqa: F401
    CONF_CORPUS_DIR,
    DEFAULT_REASONING_GYM_TASKS,
    EVAL_ONLY_KINDS,
    KINDS,
    REASONING_GYM_SEED_STRIDE,
    REASONING_KEYS,
    ROLE_ALIASES,
    SPLITS,
    CorpusConfig,
    CorpusError,
    RecordError,
    SourceConfig,
    corpus_config_from_dict,
    known_corpora,
    load_corpus_config,
    source_config_from_dict,
)
from eyas.data.corpora.mixtures import (  # noqa: F401
    CorpusSplits,
    check_trainable,
    hash01,
    load_corpus,
    split_of,
)
from eyas.data.corpora.prompt_sets import (  # noqa: F401
    load_prompt_set,
)
from eyas.data.corpora.readers import (  # noqa: F401
    JsonArrayStats,
    JsonArrayStream,
    SourceStats,
    iter_jsonl,
    iter_parquet,
    iter_records_file,
)
from eyas.data.corpora.records import (  # noqa: F401
    conversation_from_record,
    normalize_message,
    prompt_only,
)
from eyas.data.corpora.sources import (  # noqa: F401
    NATIVE_SPLIT_KINDS,
    read_source,
    reasoning_gym_seed,
)
