"""params.yaml is read as DVC reads it: a file DVC rejects, `turnrl config` rejects too (exit 2,
the line and the fix), and every unknown key lists the keys allowed where it was written."""
from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from typing import Any

import pytest
from dvc.utils.serialize import YAMLFileCorruptedError, parse_yaml

from turnrl.config import Config, ConfigError, load_config, parse_config
from turnrl.config.loading import _model_of, _section_at

from conftest import ROOT

# Unquoted module:function values DVC's loader stops on ("found unexpected ':'"): in a flow
# sequence, and in a flow mapping; (file text, line, the value to quote)
DVC_REJECTS = {
    "flow sequence": ("seed: 1\nreward:\n  functions: [my_tasks.rewards:fewer_guesses, my_tasks.rewards:brevity]\n",
                      3, "my_tasks.rewards:fewer_guesses"),
    "flow mapping": ("eval:\n  benchmarks:\n    - math500\n    - {name: mc, path: data/mc.jsonl, grader: my_tasks.grading:letter}\n",
                     4, "my_tasks.grading:letter"),
}


def _turnrl_config(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "turnrl.cli", "config", str(path)], cwd=path.parent,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("case", list(DVC_REJECTS))
def test_a_file_dvc_rejects_is_rejected_by_turnrl_config_with_the_line_and_the_fix(tmp_path, case):
    text, line, value = DVC_REJECTS[case]
    params = tmp_path / "params.yaml"
    params.write_text(text)
    with pytest.raises(YAMLFileCorruptedError):          # DVC's own loader for params.yaml
        parse_yaml(text, str(params))
    proc = _turnrl_config(params)
    assert proc.returncode == 2, proc.stderr[-2000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert f"at line {line}," in error and f"quote the value: '{value}'" in error, error
    # quoted as the message says, both loaders read it, and it is the same value
    fixed = re.sub(r"([\w.]+\.\w+:\w+)", r"'\1'", text)
    assert value in str(parse_yaml(fixed, str(params)))
    params.write_text(fixed)
    with pytest.raises(ConfigError) as err:              # my_tasks does not exist: a plugin error, not YAML
        load_config(params)
    assert "not valid YAML" not in str(err.value) and "my_tasks" in str(err.value)


def test_real_dvc_stops_on_the_same_file(tmp_path):
    """`dvc status` in a git + DVC project whose stage reads `reward` from that params.yaml."""
    text, line, value = DVC_REJECTS["flow sequence"]
    (tmp_path / "params.yaml").write_text(text)
    (tmp_path / "dvc.yaml").write_text("stages:\n  s:\n    cmd: echo\n    params: [reward]\n")
    env = {"DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
           "PATH": f"{sys.prefix}/bin:/usr/bin:/bin", "HOME": str(tmp_path)}
    for cmd in (["git", "init", "-q"], [f"{sys.prefix}/bin/dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=tmp_path, check=True, env=env, capture_output=True, timeout=120)
    proc = subprocess.run([f"{sys.prefix}/bin/dvc", "status"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode != 0 and "YAML file structure is corrupted" in proc.stderr, proc.stderr
    assert _turnrl_config(tmp_path / "params.yaml").returncode == 2


def test_a_key_written_twice_is_rejected_like_dvc_does(tmp_path):
    text = "train:\n  steps: 3\n  steps: 4\n"
    with pytest.raises(YAMLFileCorruptedError):
        parse_yaml(text, "params.yaml")
    (tmp_path / "params.yaml").write_text(text)
    with pytest.raises(ConfigError, match=r"duplicate key \"steps\".* at line 3, column 3; keep one of the two"):
        load_config(tmp_path / "params.yaml")


def test_values_are_read_as_yaml_1_2_like_dvc(tmp_path):
    """Where PyYAML (YAML 1.1) and DVC's loader disagree, the value is DVC's: 1e-5 a number, not a string."""
    (tmp_path / "params.yaml").write_text("train:\n  lr: 3e-6\n")
    assert parse_yaml("train:\n  lr: 3e-6\n", "params.yaml") == {"train": {"lr": 3e-6}}
    assert load_config(tmp_path / "params.yaml").train.lr == 3e-6


def test_an_override_keeps_dvc_s_dash_s_syntax():
    """`-S 'reward.functions=[a.b:c]'` is what `dvc exp run -S` takes: accepted unquoted."""
    with pytest.raises(ConfigError) as err:
        load_config(ROOT / "params.yaml", ["reward.functions=[my_tasks.rewards:nope]"])
    assert "reward.functions[0] = 'my_tasks.rewards:nope'" in str(err.value)
    # key= is the empty string, as dvc exp run -S writes it: a teacher switched from serve to base_url
    cfg = load_config(ROOT / "params.yaml", ["algorithm.name=opd", "reward.teacher.serve=",
                                             "reward.teacher.base_url=http://teacher:8000/v1"])
    assert cfg.reward.teacher.serve == "" and cfg.reward.teacher.base_url == "http://teacher:8000/v1"


# ----------------------------------------------------------------------------- unknown keys
def test_an_unknown_key_in_a_benchmark_mapping_lists_the_allowed_keys():
    data = {"eval": {"benchmarks": ["math500", {"name": "mine", "path": "m.jsonl", "feilds": {"prompt": "q"}}]}}
    with pytest.raises(ConfigError) as err:
        parse_config(data, plugins=False)
    assert str(err.value) == ("params.yaml: eval.benchmarks.1.feilds: unknown key (did you mean 'fields'?); "
                              "keys under eval.benchmarks.1: name, path, fields, answer_from, grader")


def _sections(annotation: Any = Config, loc: tuple = ()) -> list[tuple[tuple, type]]:
    """Every place in params where a section (a set of keys) is written: (location, its model),
    through sections, list items (index 0) and mapping values (key 'k')."""
    model = _model_of(annotation)
    if model is None:
        return []
    found = [(loc, model)]
    for name in model.model_fields:
        below = _section_at(model, name)
        for step, inner in (((), below), ((0,), _section_at(below, 0)), (("k",), _section_at(below, "k"))):
            if inner is not None and _model_of(inner) is not None:
                found += _sections(inner, loc + (name, *step))
    return found


def _nest(loc: tuple, leaf: dict) -> Any:
    if not loc:
        return leaf
    head, rest = loc[0], loc[1:]
    if isinstance(head, int):
        return [_nest(rest, leaf)]
    return {head: _nest(rest, leaf)}


def test_every_unknown_key_lists_the_allowed_keys():
    places = _sections()
    assert any(loc == ("eval", "benchmarks", 0) for loc, _ in places)   # list items are reached
    for loc, model in places:
        with pytest.raises(ConfigError) as err:
            parse_config(_nest(loc, {"zz_unknown": 1}), plugins=False)
        key = ".".join(map(str, loc + ("zz_unknown",)))
        line = next((x for x in str(err.value).splitlines() if f": {key}: unknown key" in x), None)
        assert line is not None, str(err.value)
        assert line.endswith(", ".join(model.model_fields)), line
