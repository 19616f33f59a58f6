"""Heal budgets: model sizes from the recipes, and timeouts that grow with them.

The model sizes come from torchtitan, built on the meta device in a fresh interpreter
(the CPU shims must apply before torchtitan is first imported); the rest is arithmetic.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, cli_env
from monarch_sky.config import FTSettings, TimeoutSettings
from monarch_sky.control.heal_budget import (
    RATES, TORCHFT_TIMEOUT_S, derive, state_bytes_per_rank,
)

DESCRIBE = """
import json
from monarch_sky.control.heal_budget import built_sizes, describe
out = {r: describe(r, n, k) for r, n, k in [("llama3_tiny", 2, "cpu"), ("llama3_8b", 8, "rocm"), ("llama3_70b", 8, "rocm"),
                                            ("qwen3_tiny", 2, "cpu"), ("qwen3_8b", 8, "rocm"), ("qwen3_32b", 8, "rocm")]}
for r in list(out):
    out[r]["built"] = built_sizes(r)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def described() -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", DESCRIBE], cwd=REPO, env=cli_env(), capture_output=True, text=True, timeout=180
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def today(budget) -> dict:
    """The budget's values next to the defaults they replace."""
    ft, timeouts = FTSettings(), TimeoutSettings()
    return {
        "quorum_timeout_s": (budget["quorum_timeout_s"], ft.quorum_timeout_s),
        "process_group_timeout_ms": (budget["process_group_timeout_ms"], ft.process_group_timeout_ms),
        "step_s": (budget["step_s"], timeouts.step_s),
        "ft_timeout_s": (budget["ft_timeout_s"], TORCHFT_TIMEOUT_S),
        "healing_step_s": (budget["healing_step_s"], timeouts.hang_s),
    }


@pytest.mark.parametrize("recipe,expected", [("llama3_8b", 8.03e9), ("llama3_70b", 70.6e9), ("qwen3_8b", 8.19e9),
                                             ("qwen3_32b", 32.8e9)])
def test_params_match_the_published_model_sizes(described, recipe, expected):
    assert abs(described[recipe]["params"] / expected - 1) < 0.02


@pytest.mark.parametrize("recipe", ["llama3_tiny", "llama3_8b", "llama3_70b", "qwen3_tiny", "qwen3_8b", "qwen3_32b"])
def test_a_recipes_stated_size_is_the_size_of_the_model_it_builds(described, recipe):
    from monarch_sky.recipes import RECIPES

    r = RECIPES[recipe]
    assert described[recipe]["built"] == [r.params, r.largest_param, r.vocab_size]


def test_an_8b_rank_receives_about_12_gb():
    assert abs(state_bytes_per_rank(8_030_000_000, 8) / 12.0e9 - 1) < 0.01
    assert state_bytes_per_rank(1000, 3) == 4000


def test_the_tiny_recipe_keeps_todays_defaults(described):
    tiny = described["llama3_tiny"]
    assert tiny["transport"] == "tcp"
    for name, (value, default) in today(tiny).items():
        if name != "healing_step_s":  # a new allowance; the config's hang_s stays
            assert value == default, name
    assert tiny["healing_step_s"] <= 15


def test_big_models_get_longer_timeouts_that_cover_their_heal(described):
    b8, b70 = described["llama3_8b"], described["llama3_70b"]
    assert b8["transport"] == b70["transport"] == "tcp"
    assert b70["heal_s"] > 2 * b70["bytes_per_rank"] / RATES["gpu"]["tcp"]
    for b in (b8, b70):  # every bound of the transport is the manager's timeout
        assert b["ft_timeout_s"] >= b["heal_s"]
    for name, (value, default) in today(b70).items():
        assert value >= today(b8)[name][0] >= default, name
    assert b70["ft_timeout_s"] > TORCHFT_TIMEOUT_S and b70["quorum_timeout_s"] > FTSettings().quorum_timeout_s
    assert b70["quorum_timeout_s"] < b70["step_s"]  # config validation's rule


@pytest.mark.parametrize("median_step_s", [0.0, 1.0, 30.0])
def test_timeouts_grow_with_the_state_and_never_drop_below_the_defaults(median_step_s):
    rate = RATES["gpu"]["http"]
    budgets = [derive(int(gb * 1e9), rate, median_step_s, largest_tensor_bytes=int(gb * 1e8))
               for gb in (0.001, 1, 12, 106, 1000)]
    ft, timeouts = FTSettings(), TimeoutSettings()
    for smaller, larger in zip(budgets, budgets[1:]):
        for name, value in vars(smaller).items():
            assert getattr(larger, name) >= value, name
    for b in budgets:
        assert b.quorum_timeout_s >= ft.quorum_timeout_s and b.ft_timeout_s >= TORCHFT_TIMEOUT_S
        assert b.process_group_timeout_ms >= ft.process_group_timeout_ms
        assert b.step_s >= timeouts.step_s and b.healing_step_s >= timeouts.hang_s
        assert b.quorum_timeout_s < b.step_s
        assert b.healing_step_s >= b.heal_s + median_step_s
    assert budgets[-1].process_group_timeout_ms > ft.process_group_timeout_ms  # a 100 GB tensor


def test_a_big_job_gets_its_heal_timeouts_raised_and_a_tiny_one_keeps_its_own():
    from omegaconf import OmegaConf

    from monarch_sky.config import JobConfig
    from monarch_sky.control.heal_budget import apply
    from monarch_sky.recipes import RECIPES

    def job(recipe, **overrides):
        return OmegaConf.merge(OmegaConf.structured(JobConfig), RECIPES[recipe].job_defaults, {"recipe": recipe}, overrides)

    tiny = job("llama3_tiny", timeouts={"step_s": 240.0})
    apply(tiny, "cpu")
    assert (tiny.ft.timeout_s, tiny.ft.quorum_timeout_s, tiny.timeouts.step_s) == (60, 60, 240.0)  # never lowered
    short = job("llama3_tiny", ft={"process_group_timeout_ms": 2000})
    assert apply(short, "cpu")["applied"]["ft.process_group_timeout_ms"] == 2000, "a shorter collective timeout is kept"
    big = job("llama3_70b")
    budget = apply(big, "rocm")
    assert budget["transport"] == "tcp"
    assert big.ft.timeout_s == budget["ft_timeout_s"] > 60
    assert big.ft.quorum_timeout_s == budget["quorum_timeout_s"] < big.timeouts.step_s == budget["step_s"]
    assert big.ft.process_group_timeout_ms == budget["process_group_timeout_ms"] >= 5000
    assert budget["applied"]["ft.process_group_timeout_ms"] == big.ft.process_group_timeout_ms
    assert budget["applied"]["timeouts.step_s"] == big.timeouts.step_s


def test_a_job_that_heals_over_http_is_budgeted_at_https_rate():
    from omegaconf import OmegaConf

    from monarch_sky.config import JobConfig
    from monarch_sky.control.heal_budget import apply
    from monarch_sky.recipes import RECIPES

    def job(transport):
        return OmegaConf.merge(OmegaConf.structured(JobConfig), RECIPES["llama3_8b"].job_defaults,
                               {"recipe": "llama3_8b", "ft": {"heal_transport": transport}})

    http, tcp = apply(job("http"), "cpu"), apply(job("auto"), "cpu")
    assert (http["transport"], tcp["transport"]) == ("http", "tcp")
    assert http["rate_bytes_per_s"] == RATES["cpu"]["http"] < tcp["rate_bytes_per_s"] == RATES["cpu"]["tcp"]
    assert http["ft_timeout_s"] >= http["heal_s"] > tcp["heal_s"], "HTTP's lock is the manager timeout: it covers the heal"


def test_a_checkpointing_job_keeps_the_saving_group_in_the_quorum():
    from omegaconf import OmegaConf

    from monarch_sky.config import JobConfig
    from monarch_sky.control.heal_budget import apply, checkpoint_pause_s
    from monarch_sky.recipes import RECIPES

    def job(recipe, **overrides):
        return OmegaConf.merge(OmegaConf.structured(JobConfig), RECIPES[recipe].job_defaults, {"recipe": recipe}, overrides)

    big = job("llama3_8b")  # its recipe checkpoints
    budget = apply(big, "rocm")
    pause_s = checkpoint_pause_s(budget["bytes_per_rank"])
    assert pause_s > 10, "premise: an 8B save pauses longer than TorchFT's default join timeout"
    assert big.ft.join_timeout_ms >= 2 * pause_s * 1000 and big.ft.quorum_timeout_s >= 2 * pause_s
    tiny = job("llama3_tiny", checkpoint={"every_min": 1.0})
    apply(tiny, "cpu")
    assert tiny.ft.join_timeout_ms == 10000, "a tiny save never raises it"
    off = job("llama3_8b", checkpoint={"every_min": 0.0})
    apply(off, "rocm")
    assert off.ft.join_timeout_ms == 10000 and "checkpoint_pause_s" not in apply(off, "rocm")
