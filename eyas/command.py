"""One way to write a command: a :class:`Command` (its primary config in ``conf/``, its typed job and its ``run``),
and :meth:`Command.main`, the Hydra app built from it. ``eyas <name>`` (:mod:`eyas.cli`) and
``python -m <module>`` both call that app.

What every command gets from this one place:
- Its inputs under its own key, named for what they are: ``eval.export_dir`` is an exported drafter,
  ``export.checkpoint`` a trainer checkpoint, ``diagnose.chain_length`` a setting of diagnose.
- An old spelling (:attr:`Command.renamed`: ``eval.checkpoint``, diagnose's top-level ``drafter=``) refused by
  name with the new one to write, before Hydra runs.
- An unknown top-level key (``+trian.lr=1``: Hydra itself suggests the ``+`` for a typo) refused with the nearest
  key of the command suggested, where Hydra would add it and the command would never read it.
- Bad settings and inputs end the command with one line on stderr and exit status 2: a wrong type or unknown key
  (:func:`eyas.common.build_config`), a value a config refuses, and the errors eyas raises about its inputs
  (:func:`is_input_error`). ``EYAS_DEBUG=1`` (or Hydra's ``HYDRA_FULL_ERROR=1``) shows the traceback instead.
- ``--help``: the command's groups and its own keys, composed with the overrides given (Hydra's ``--cfg job``
  prints the whole composed config, ``--hydra-help`` Hydra's own flags).
- :func:`dry_run`: the job a command line would run, checked and built but not run (the README's command lines
  are tested with it).

Design decisions:
- A job is a dataclass whose fields are the top-level keys the command reads (``TrainJob``: ``target``,
  ``drafter``, ``train``), built with :func:`eyas.common.load_job`; a command whose job is one key's config (the
  micro-benchmarks, ``plan``) names that key (:attr:`Command.key`); a job assembled from several keys
  (``prepare`` folds ``corpus`` into its config) brings its own :attr:`Command.load`.
- The checks on the command line run before Hydra composes anything, so an old or unknown key is one line of
  eyas's, not Hydra's "Could not override" paragraph; they parse the overrides with Hydra's own parser.
- Like :mod:`eyas.common` it imports nothing from the stages (only ``eyas.cli``'s table of commands, for help), so
  every stage's entry point can use it.
- Only errors that name what to change become one line: a library's exception from deep inside a run (a bug, not
  a bad input) keeps its traceback.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import linecache
import os
import shlex
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.common import ConfigError, build_config, load_job

CONF_MODULE = "eyas.conf"
DEBUG_ENV = ("EYAS_DEBUG", "HYDRA_FULL_ERROR")
"""Set either to 1 and a bad input ends with its traceback instead of one line."""
_PACKAGES = ("eyas", "eyas.data", "eyas.train", "eyas.serving", "eyas.eval")


@dataclass(frozen=True)
class Command:
    """A command: what ``eyas <name>`` and ``python -m <module>`` run."""

    name: str
    """``eyas <name>`` (a name :mod:`eyas.cli` lists; the micro-benchmarks are ``python -m`` only)."""
    module: str
    """``python -m <module>``."""
    config: str
    """The primary config, ``conf/<config>.yaml``."""
    job: type
    """The typed job :attr:`run` takes (a dataclass)."""
    run: Callable[[Any], Any]
    """Runs the job; an ``int`` it returns is the exit status (anything else: 0)."""
    key: str | None = None
    """The top-level key whose config is the whole job (``plan``, ``bench_train``); None: each field of
    :attr:`job` is the top-level key of the same name."""
    load: Callable[[Any], Any] | None = None
    """Builds the job from the composed config where no plain :func:`eyas.common.load_job` does."""
    reads: tuple[str, ...] = ()
    """Top-level keys :attr:`load` reads besides the job's fields (``prepare`` reads ``corpus`` too)."""
    renamed: Mapping[str, str] = field(default_factory=dict)
    """Old spellings refused by name: ``{old key: new key}`` (a key or the start of one)."""

    @property
    def keys(self) -> tuple[str, ...]:
        """The top-level keys this command reads."""
        if self.key is not None:
            return (self.key,)
        return tuple(f.name for f in dataclasses.fields(self.job) if f.init) + self.reads

    @property
    def usage(self) -> str:
        from eyas.cli import COMMANDS

        if self.name in COMMANDS:
            return f"eyas {self.name}"
        return f"python -m {self.module}"

    def build(self, cfg: Any) -> Any:
        """The typed job from the composed config ``cfg``."""
        if self.load is not None:
            return self.load(cfg)
        if self.key is not None:
            return build_config(self.job, cfg[self.key], self.key)
        return load_job(cfg, self.job)

    def main(self) -> None:
        """The Hydra app: ``sys.argv[1:]`` are its overrides and Hydra's flags."""
        import hydra

        args = hydra_args(sys.argv[1:])
        if args.help:
            print_help(self, args.overrides)
            raise SystemExit(0)
        _one_line(lambda: check_overrides(self, args.overrides, args.config_name))

        @hydra.main(config_path=f"pkg://{CONF_MODULE}", config_name=self.config, version_base="1.3")
        def app(cfg: Any) -> None:
            job = _one_line(lambda: self.build(cfg), build=True)
            code = _one_line(lambda: self.run(job))
            if isinstance(code, int) and not isinstance(code, bool):
                raise SystemExit(code)

        app()


def command_line(cmd: Command) -> str:
    """The command as the user typed it (for reports that say how to reproduce them)."""
    return " ".join([f"python -m {cmd.module}", shlex.join(sys.argv[1:])]).strip()


# -- errors -------------------------------------------------------------------------------------------------------
def _eyas_dirs() -> tuple[str, ...]:
    dirs = []
    for name in _PACKAGES:
        spec = importlib.util.find_spec(name)
        dirs += [str(Path(p).resolve()) + os.sep for p in (spec.submodule_search_locations or [])]
    return tuple(dirs)


def is_input_error(e: BaseException, build: bool = False) -> bool:
    """Whether ``e`` says what to change in the command's settings or inputs (one line, exit status 2): an error
    class eyas defines (``ConfigError``, ``CorpusError``, ``StoreError``, ``DrafterLoadError``, ...); a plain
    ``ValueError`` / ``RuntimeError`` raised by a ``raise`` in eyas's code (``train.epochs must be positive``), or any
    ``ValueError`` while the job is built (``build``); a file that is missing or cannot be read, named. Anything
    else (a library's error from deep inside a run) is a bug to report, with its traceback."""
    if not isinstance(e, Exception) or isinstance(e, AssertionError):
        return False
    if type(e).__module__.split(".")[0] == "eyas":
        return True
    if isinstance(e, ValueError) and build:
        return True
    if isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError)):
        return e.filename is not None
    if type(e) in (ValueError, RuntimeError) and e.__traceback__ is not None:
        tb = e.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        # eyas's own `raise ValueError(...)`, not an operation in eyas code that failed (a shape mismatch)
        where = tb.tb_frame.f_code.co_filename
        line = linecache.getline(where, tb.tb_lineno).strip()
        return str(Path(where).resolve()).startswith(_eyas_dirs()) and line.startswith("raise ")
    return False


def _one_line(fn: Callable[[], Any], build: bool = False) -> Any:
    """``fn()``; an input error ends the command with its message on one line and exit status 2."""
    try:
        return fn()
    except Exception as e:
        if not is_input_error(e, build) or any(os.environ.get(v, "") not in ("", "0") for v in DEBUG_ENV):
            raise
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


# -- the command line ---------------------------------------------------------------------------------------------
@dataclass
class HydraArgs:
    overrides: list[str]
    help: bool = False
    config_name: str | None = None
    """``--config-name`` / ``-cn``, where given."""


def hydra_args(argv: list[str]) -> HydraArgs:
    """The overrides and the flags eyas looks at, parsed as Hydra parses them."""
    from hydra._internal.utils import get_args_parser

    args, rest = get_args_parser().parse_known_args(argv)
    overrides = list(args.overrides) + [a for a in rest if not a.startswith("-")]
    return HydraArgs(overrides, bool(args.help), args.config_name)


@dataclass
class _Override:
    text: str
    """As typed: ``+trian.lr=1``."""
    key: str
    """The key or group: ``trian.lr``."""

    @property
    def top(self) -> str:
        """The top-level key (``trian``; ``hydra`` for ``hydra/launcher=...``)."""
        return self.key.split(".", 1)[0].split("/", 1)[0]

    @property
    def value(self) -> str | None:
        return self.text.split("=", 1)[1] if "=" in self.text else None


def _parse(overrides: list[str]) -> list[_Override]:
    """The overrides' keys (Hydra's parser; an override it cannot parse is left for Hydra to report)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    out = []
    for text in overrides:
        try:
            (o,) = parser.parse_overrides([text])
        except HydraException:
            continue
        out.append(_Override(text, o.key_or_group))
    return out


def command_line_sets(top: str) -> bool:
    """Whether the running command's line sets the top-level key ``top`` (``target=hf``, ``target.path=x``,
    ``+target.x=1``); True outside a Hydra app (a caller that built the job itself chose every value)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return True
    return any(o.top == top for o in _parse(list(HydraConfig.get().overrides.task)))


def compose(config: str, overrides: list[str] | tuple[str, ...] = ()) -> Any:
    """``conf/<config>.yaml`` composed with ``overrides`` by Hydra's compose API (inside a Hydra app or not)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return hydra_compose(config, overrides=list(overrides))
    with initialize_config_module(CONF_MODULE, version_base="1.3"):
        return hydra_compose(config, overrides=list(overrides))


def check_overrides(cmd: Command, overrides: list[str], config: str | None = None) -> None:
    """A :class:`~eyas.common.ConfigError` naming the first override that uses an old spelling of a key (and the
    new one to write) or a top-level key the command's config does not have (and the nearest one it has)."""
    parsed = _parse(overrides)
    for o in parsed:
        for old, new in cmd.renamed.items():
            if o.key == old or o.key.startswith(old + "."):
                key = new + o.key[len(old) :]
                write = key if o.value is None else f"{key}={o.value}"
                raise ConfigError(f"{o.text}: {cmd.usage} spells this {key} now; write {write}")
    base = None
    for o in parsed:
        if o.top in cmd.keys or o.top == "hydra":
            continue
        base = base if base is not None else compose(config or cmd.config)
        if o.top in base:
            continue
        raise ConfigError(
            f"{o.text}: unknown key {o.top!r}{_suggest(cmd, o, base)}; {cmd.usage} reads {', '.join(cmd.keys)}"
        )


def _suggest(cmd: Command, o: _Override, base: Any) -> str:
    """`` (did you mean train.lr=1?)`` for the nearest key the command reads, or the group holding the key."""
    rest = o.key[len(o.top) :]
    near = difflib.get_close_matches(o.top, cmd.keys, n=1, cutoff=0.6)
    if near:
        key = near[0] + rest
    else:
        holders = [k for k in cmd.keys if k in base and hasattr(base[k], "keys") and o.top in base[k]]
        if not holders:
            return ""
        key = f"{holders[0]}.{o.key}"
    return f" (did you mean {key if o.value is None else f'{key}={o.value}'}?)"


def dry_run(cmd: Command, overrides: list[str]) -> Any:
    """The job ``overrides`` make, checked as the command checks them and built, without running it."""
    check_overrides(cmd, overrides)
    return cmd.build(compose(cmd.config, overrides))


# -- help ---------------------------------------------------------------------------------------------------------
def print_help(cmd: Command, overrides: list[str]) -> None:
    """The command's groups and its own keys (composed with ``overrides``), and how it reports bad input."""
    from hydra import initialize_config_module
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    from eyas.cli import COMMANDS

    what = COMMANDS[cmd.name][1] if cmd.name in COMMANDS else _first_line(cmd)
    print(f"{cmd.usage}: {what}\n")
    print(
        f"usage: {cmd.usage} [key=value ...]"
        + (f"  (= python -m {cmd.module})" if "eyas " in cmd.usage else "")
    )
    _one_line(lambda: check_overrides(cmd, overrides))
    with initialize_config_module(CONF_MODULE, version_base="1.3"):
        loader = GlobalHydra.instance().config_loader()
        groups = {k: loader.get_group_options(k) for k in cmd.keys if loader.get_group_options(k)}
        cfg = _one_line(lambda: compose(cmd.config, overrides), build=True)
    if groups:
        print("\n== Configuration groups ==\nChoose one with group=option\n")
        print("\n".join(f"{k}: {', '.join(v)}" for k, v in groups.items()))
    own = sorted(cmd.keys, key=lambda k: k != (cmd.key or cmd.name))  # eval's own key first, then the rest
    example = next(
        (f"{k}.{sub}=..." for k in own if hasattr(cfg.get(k), "keys") for sub in cfg[k]), "key=..."
    )
    print(f"\n== Config ==\nWhat {cmd.usage} reads; override any key ({example})\n")
    print(OmegaConf.to_yaml(OmegaConf.masked_copy(cfg, [k for k in cmd.keys if k in cfg])))
    print(
        "A bad key, type or value, or an input eyas cannot use, ends the command with one line and exit status 2 "
        "(EYAS_DEBUG=1: with the traceback).\n--cfg job prints the whole composed config; --hydra-help Hydra's "
        "own flags."
    )


def _first_line(cmd: Command) -> str:
    """The first line of the docstring of the module that defines the command's ``run``."""
    module = sys.modules.get(getattr(cmd.run, "__module__", ""), None)
    return ((module.__doc__ if module else None) or "").strip().split("\n", 1)[0]
