"""Fuzzing params with hypothesis: any YAML-shaped value at any key, known or not, gives either a
valid Config or a ConfigError whose every line names the key it is about. Never another
exception.

The number of examples per test is TURNRL_FUZZ_EXAMPLES (default 200); the module prints how
many cases each test tried (`pytest tests/test_config_fuzz.py`), or run hypothesis' own
statistics with `--hypothesis-show-statistics`.
"""
from __future__ import annotations

import os
import re
from collections import Counter

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from turnrl.config import Config, ConfigError, load_config, parse_config

from conftest import print_past_capture

EXAMPLES = int(os.environ.get("TURNRL_FUZZ_EXAMPLES", "200"))
FUZZ = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
TRIED: Counter = Counter()


def _paths(model: type[BaseModel] = Config, prefix: str = "") -> tuple[list[str], list[str]]:
    """(dotted leaf keys, dotted section keys) of the params schema."""
    leaves, sections = [], []
    for name, f in model.model_fields.items():
        key = prefix + name
        if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel):
            sections.append(key)
            sub_leaves, sub_sections = _paths(f.annotation, key + ".")
            leaves += sub_leaves
            sections += sub_sections
        else:
            leaves.append(key)
    return leaves, sections


LEAVES, SECTIONS = _paths()
NAMES = sorted({part for key in LEAVES + SECTIONS for part in key.split(".")})
WORDS = ["grpo", "ppo", "vllm", "hf", "tiny", "synthetic", "code_tool", "search", "float32", "chat",
         "math500", "single", "k3", "token-mean", "endpoint", "self", "both", "1e-4", "-3", "yes", ""]

scalars = (st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.integers()
           | st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=False) | st.text(max_size=12) | st.sampled_from(WORDS))
any_key = st.sampled_from(NAMES) | st.text(max_size=8) | st.integers() | st.booleans() | st.none()
yamlish = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                       | st.dictionaries(any_key, inner, max_size=4), max_leaves=12)
dotted = (st.sampled_from(LEAVES + SECTIONS)
          | st.builds(lambda base, extra: f"{base}.{extra}", st.sampled_from(SECTIONS + LEAVES),
                      st.from_regex(r"[a-z_]{1,8}", fullmatch=True))
          | st.from_regex(r"[a-z_]{1,8}(\.[a-z_]{1,8}){0,2}", fullmatch=True))


def _set(data: dict, key: str, value) -> None:
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(data.get(part), dict):
            data[part] = {}
        data = data[part]
    data[parts[-1]] = value


def _key_of(line: str, source: str) -> str:
    m = re.match(re.escape(source) + r": (.+?)(?: = |: )", line)
    assert m, f"an error line that names no key: {line!r}"
    return m.group(1)


def _check_message(exc: ConfigError, source: str, changed: list[str] | None = None) -> None:
    lines = str(exc).splitlines()
    assert lines and all(line.startswith(source + ": ") for line in lines), str(exc)
    assert all(len(line) < 1200 for line in lines), "an error line too long to read"
    if changed is None:
        return
    for line in lines:
        key = _key_of(line, source)
        if key == "params":     # a check across sections: it names the keys in its text
            assert any(p in line for p in changed), (line, changed)
        else:
            assert any(key == p or key.startswith(p + ".") or p.startswith(key + ".") for p in changed), \
                (line, changed)


# --------------------------------------------------------------------------- parse_config
@FUZZ
@given(data=yamlish | st.dictionaries(st.sampled_from(NAMES) | any_key, yamlish, max_size=5))
def test_any_yaml_value_gives_a_config_or_a_clear_error(data):
    TRIED["parse_config: any value"] += 1
    try:
        cfg = parse_config(data)
    except ConfigError as exc:
        _check_message(exc, "params.yaml")
    else:
        assert isinstance(cfg, Config)


@FUZZ
@given(changes=st.lists(st.tuples(dotted, yamlish), min_size=1, max_size=4))
def test_changed_keys_give_a_config_or_an_error_naming_them(changes):
    TRIED["parse_config: changed keys"] += 1
    data = Config().model_dump()
    for key, value in changes:
        _set(data, key, value)
    try:
        cfg = parse_config(data)
    except ConfigError as exc:
        _check_message(exc, "params.yaml", [key for key, _ in changes])
    else:
        assert isinstance(cfg, Config)


# --------------------------------------------------------------------------- load_config
@pytest.fixture(scope="module")
def params_file(tmp_path_factory):
    """The defaults in YAML flow style: 2-3x faster to parse per example than the commented file."""
    path = tmp_path_factory.mktemp("fuzz") / "params.yaml"
    path.write_text(yaml.safe_dump(Config().model_dump(), default_flow_style=True, width=10**6))
    return path


@pytest.mark.parametrize("raw", ["[", "{a: ", "@x", "%", "*alias", "!!python/object:os.system x", "2020-13-45",
                                 "!!int x", "!!timestamp x", "!!bool maybe", "{a: 1, a: 2}", "[" * 600])
def test_override_values_the_loader_cannot_read_are_a_clear_error(params_file, raw):
    """ruamel's safe loader (DVC's) raises YAMLError, ValueError, KeyError or RecursionError on these."""
    with pytest.raises(ConfigError, match=r"^override train\.steps: the value .* is not valid YAML"):
        load_config(params_file, [f"train.steps={raw}"])


raw_values = (st.text(max_size=16) | yamlish.map(lambda v: yaml.safe_dump(v, default_flow_style=True).strip())
              | st.sampled_from(["[", "{a: ", "!!python/object:os.system x", "*alias", "- a\n- b", "%", "@x",
                                 "2020-13-45", "!!int x", "!!timestamp x", "{[1]: 2}"]))


@FUZZ
@given(overrides=st.lists(st.one_of(
    st.builds(lambda k, v: f"{k}={v}", dotted, raw_values),
    st.text(max_size=16)), max_size=3))
def test_overrides_give_a_config_or_a_clear_error(params_file, overrides):
    TRIED["load_config: overrides"] += 1
    try:
        cfg = load_config(params_file, overrides)
    except ConfigError as exc:
        lines = str(exc).splitlines()
        assert lines and all(line.startswith(("params.yaml: ", "override ")) for line in lines), str(exc)
    else:
        assert isinstance(cfg, Config)


@FUZZ
@given(content=st.text(max_size=200) | st.binary(max_size=100)
       | yamlish.map(lambda v: yaml.safe_dump(v, allow_unicode=True)))
def test_any_params_file_gives_a_config_or_a_clear_error(tmp_path_factory, content):
    TRIED["load_config: file content"] += 1
    path = tmp_path_factory.mktemp("content") / "params.yaml"
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    try:
        cfg = load_config(path)
    except ConfigError as exc:
        assert str(exc).startswith(str(path.name)) or str(exc).startswith(str(path)), str(exc)
    else:
        assert isinstance(cfg, Config)


def test_a_params_path_that_is_a_folder_or_missing_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not a file"):
        load_config(tmp_path)


@pytest.fixture(scope="module", autouse=True)
def _print_counts(request):
    yield
    if TRIED:
        print_past_capture(request, "\nparams fuzz, cases tried (all answered with a Config or a ConfigError): "
                           + ", ".join(f"{k}: {v}" for k, v in TRIED.items()) + f"; total {sum(TRIED.values())}")
