"""The installed shape: one top-level package, ``eyas``, that a user's own ``data/`` or ``train.py`` cannot shadow."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ("pyproject.toml", "README.md", "eyas", "data", "train", "serving", "eval", "conf")


def test_the_wheel_holds_only_the_eyas_package_with_its_configs(tmp_path):
    src = tmp_path / "src"
    for name in SOURCES:  # build from a copy, so the build leaves nothing in the working tree
        p = ROOT / name
        if p.is_dir():
            shutil.copytree(p, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(p, src / name)
    out = tmp_path / "wheel"
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        str(src),
        "--no-deps",
        "--no-build-isolation",
        "-v",
        "-w",
        str(out),
    ]
    build = subprocess.run(cmd, check=True, cwd=tmp_path, capture_output=True, text=True)
    # every config folder is a declared package (setuptools warns about data folders it was not told of)
    assert "absent from the `packages` configuration" not in build.stdout + build.stderr
    (whl,) = out.glob("eyas-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    top = {n.split("/")[0] for n in names}
    assert {t for t in top if not t.endswith(".dist-info")} == {"eyas"}, sorted(top)
    for member in (
        "eyas/common.py",
        "eyas/cli.py",
        "eyas/data/corpora/sources.py",
        "eyas/data/corpora/word_problems.jsonl",
        "eyas/train/__main__.py",
        "eyas/serving/load.py",
        "eyas/eval/diagnose/__main__.py",
        "eyas/conf/config.yaml",
        "eyas/conf/train/default.yaml",
        "eyas/conf/diagnose/smoke.yaml",
        "eyas/conf/deepspeed/zero2.json",
    ):
        assert member in names, member
    yamls = {
        n.removeprefix("eyas/conf/") for n in names if n.startswith("eyas/conf/") and n.endswith(".yaml")
    }
    assert yamls == {str(p.relative_to(ROOT / "conf")) for p in (ROOT / "conf").rglob("*.yaml")}


def test_commands_work_from_a_directory_with_its_own_data_package_and_train_py(tmp_path):
    # a user's project whose own modules would break anything that imported them instead of eyas's
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "__init__.py").write_text(
        "raise ImportError('the user data package was imported')\n"
    )
    (tmp_path / "train.py").write_text("raise SystemExit('the user train.py was run')\n")
    (tmp_path / "conf").mkdir()  # nor does a local conf/ replace eyas's configs
    bindir = Path(sys.executable).parent
    env = {**os.environ, "PYTHONPATH": ""}

    def run(*cmd: str) -> str:
        res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, (cmd, res.stdout[-2000:], res.stderr[-2000:])
        return res.stdout

    assert "commands:" in run(str(bindir / "eyas"), "--help")
    assert "train: bench, default, demo, gpu, smoke" in run(sys.executable, "-m", "eyas.train", "--help")
    out = run(sys.executable, "-c", "import eyas, eyas.data, eyas.train; print(eyas.data.__file__)")
    assert Path(out.strip()).parent == ROOT / "data"
