"""A warm spare's step on dummy data (`hosts.spare_warm_up`) and the node's kernel cache."""

from __future__ import annotations

import os

import pytest
import torch

from monarch_sky.common import platform as platform_mod
from monarch_sky.config import load_job
from monarch_sky.recipes import TrainerSpec
from monarch_sky.replica.warm_up_step import wanted, warm_up_step


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv(platform_mod.INDUCTOR_CACHE_ENV, raising=False)
    return tmp_path


def test_auto_warms_up_on_gpus_only():
    assert [wanted("auto", kind) for kind in ("rocm", "cuda", "cpu")] == [True, True, False]
    assert wanted("always", "cpu") and not wanted("never", "rocm")


def test_the_warm_up_step_trains_nothing_and_leaves_the_process_as_it_was(home):
    spec = TrainerSpec.from_job(load_job([]).config, 0, str(home / "dump"))
    assert warm_up_step(spec, "auto", 0) is None, "the CPU path compiles nothing: auto skips it"
    before = (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads())
    seconds = warm_up_step(spec, "always", 0)
    assert seconds is not None and seconds > 0
    assert (torch.get_default_dtype(), torch.is_grad_enabled(), torch.get_num_threads()) == before
    assert os.environ[platform_mod.INDUCTOR_CACHE_ENV] == str(home / ".cache" / "monarch-sky" / "inductor")


def test_a_kernel_cache_folder_the_user_set_is_kept(home, monkeypatch):
    monkeypatch.setenv(platform_mod.INDUCTOR_CACHE_ENV, "/scratch/kernels")
    assert platform_mod.keep_kernels_on_node() == "/scratch/kernels"
