"""Every default prompt set of every command measures out-of-distribution reasoning, or names itself in-distribution
(issue 35: diagnose, the served-acceptance bench and the worked examples defaulted to reasoning-gym siblings of the
training mixture, labelled "hard reasoning")."""

import re
from pathlib import Path

import yaml

from eyas.eval.diagnose.config import DiagnoseConfig
from eyas.lab.bench_served import BenchServedConfig

ROOT = Path(__file__).resolve().parents[2]
IN_DIST_SOURCES = {"reasoning_gym"}


def _sets(node):
    if isinstance(node, dict):
        if "source" in node and "name" in node:
            yield node
        for v in node.values():
            yield from _sets(v)
    elif isinstance(node, list):
        for v in node:
            yield from _sets(v)


def test_no_config_calls_a_training_sibling_set_held_out():
    bad = []
    for path in sorted((ROOT / "conf").rglob("*.yaml")):
        for s in _sets(yaml.safe_load(path.read_text())):
            src = str(s["source"]).split("/")[0]
            if src in IN_DIST_SOURCES and not str(s["name"]).endswith("_in_dist"):
                bad.append(f"{path.relative_to(ROOT)}: {s['name']}")
    assert not bad, f"reasoning-gym sets not named *_in_dist: {bad}"


def test_the_examples_evaluate_out_of_distribution():
    text = (ROOT / "examples" / "common.sh").read_text()
    sources = re.findall(r"source: ([\w:/.]+)", text)
    assert sources and not set(sources) & IN_DIST_SOURCES, sources


def test_code_defaults_are_out_of_distribution():
    assert DiagnoseConfig().prompt_sets[0].source == "ood_reasoning"
    assert BenchServedConfig().source == "ood_reasoning"
