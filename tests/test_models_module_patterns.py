"""models/module_patterns.py: transformers' modules_to_not_convert matching without a
backtracking engine. Pinned against Python's `re` (which transformers uses) on random patterns
and names short enough for `re` to answer quickly, and on what it refuses."""
from __future__ import annotations

import random
import re

import pytest

from glm5_hal.models.module_patterns import MAX_PATTERN_LENGTH, ModulePattern, PatternError

ATOMS = ["a", "b", "x", "1", "_", "-", ".", r"\.", "[ab]", "[^a]", "[a-c.]", "[]a]", "[a-]", r"\d", r"\w", r"\s",
         "^", "$", r"\A", r"\Z", "{", "}", "]", "a{", "{1", "{,}", r"\-"]
QUANTIFIERS = ["*", "+", "?", "*?", "+?", "??", "{2}", "{1,3}", "{,2}", "{2,}", "{0}", "{0,1}"]


def transformers_skips(key: str, name: str) -> bool:
    """transformers 5.24.0 quantizers/quantizers_utils.py should_convert_module, negated."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return bool(re.match(rf"(?:{key}){boundary}", name) or name.endswith(key))


def random_pattern(rng: random.Random, depth: int = 0, repeats: int = 0) -> str:
    """At most two nested repeats: with more, Python's re (the oracle) itself takes seconds on
    9-character names (`(((?:[a-c.]){,2}){1,3}){2,}` and the like: what this module avoids)."""
    r = rng.random()
    if depth > 3 or r < 0.35:
        return rng.choice(ATOMS)
    if r < 0.55:
        return random_pattern(rng, depth + 1, repeats) + random_pattern(rng, depth + 1, repeats)
    if r < 0.7 or repeats >= 2:
        return f"({random_pattern(rng, depth + 1, repeats)}|{random_pattern(rng, depth + 1, repeats)})"
    group = rng.choice(["(", "(?:", "(?P<g>"]) if depth == 0 else rng.choice(["(", "(?:"])
    return f"{group}{random_pattern(rng, depth + 1, repeats + 1)}){rng.choice(QUANTIFIERS)}"


def test_random_patterns_match_exactly_as_pythons_re_does():
    rng = random.Random(0)
    compared = 0
    for _ in range(3000):
        key = random_pattern(rng)
        try:
            re.compile(key)
        except re.error:
            with pytest.raises(PatternError):
                ModulePattern(key)
            continue
        pattern = ModulePattern(key)
        for _ in range(8):
            name = "".join(rng.choice("ab._1x\n-") for _ in range(rng.randint(0, 9)))
            assert pattern.matches(name) == transformers_skips(key, name), (key, name)
            compared += 1
    assert compared > 15000


@pytest.mark.parametrize("key, name, skipped", [
    ("lm_head", "lm_head", True), ("model.layers.1", "model.layers.1.mlp", True),
    ("model.layers.1", "model.layers.11.mlp", False), ("layers.*.gate", "model.layers.3.mlp.gate", False),
    ("mlp.gate", "model.layers.3.mlp.gate", True), ("mlp.gate", "model.layers.3.mlp.gate_proj", False),
    (r"model\.layers\.\d+\.self_attn", "model.layers.12.self_attn.kv_b_proj", True),
    ("model.layers.(0|2)", "model.layers.2.mlp", True), ("model.layers.(0|2)", "model.layers.20.mlp", False)])
def test_module_boundaries(key, name, skipped):
    assert ModulePattern(key).matches(name) is skipped is transformers_skips(key, name)


@pytest.mark.parametrize("key", [r"(a)\1", "(?=a)", "(?!a)", "(?<=a)", "(?<!a)", "(?i)a", "(?P=g)", "a*+", "a++",
                                 "a?+", "a**", r"\b", r"\B", r"\x41", r"\u0041", "a{101}", "a{3,1}", "(a", "a)",
                                 "[a", "*a", "^*", "$+", "[[:alpha:]]", "x" * (MAX_PATTERN_LENGTH + 1)])
def test_what_only_backtracking_or_nothing_can_match_is_refused(key):
    with pytest.raises(PatternError):
        ModulePattern(key)


def test_nested_repeats_stay_linear_in_the_name():
    """Keys that take Python's re exponential time answer correctly here (the names are long
    enough that re would not finish)."""
    name = "model.layers.12.mlp.experts.123.gate_proj." * 3
    assert not ModulePattern("(.*)*X").matches(name)
    assert not ModulePattern("(x+x+)+y").matches("x" * 60)
    assert ModulePattern("(.*)*proj").matches(name)
    assert ModulePattern("(a|aa)*b").matches("a" * 80 + "b")
