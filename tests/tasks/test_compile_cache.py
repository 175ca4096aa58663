"""The step containers' compile cache: which host folder, how it reaches a container, how it is
turned off. The container itself writing there is tests/tasks/test_docker_runner.py's."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen.errors import CannotRunHereError
from tasks.docker_runner import COMPILE_CACHE_PATH, DockerRunner
from tasks.runners import StepInvocation
from tasks.settings import compile_cache


def _args(env: dict | None = None) -> dict:
    runner = DockerRunner({"*": "datagen-steps:unused"}, client=object())  # nothing is created
    return runner._create_args(StepInvocation(step="extract", args=(), env=env or {}))


def _cache_mounts(args: dict) -> list:
    return [m for m in args["mounts"] if m["Target"] == COMPILE_CACHE_PATH]


def test_by_default_the_users_cache_folder_is_mounted_and_named_to_the_compilers(monkeypatch, tmp_path):
    monkeypatch.delenv("DATAGEN_COMPILE_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert compile_cache() == tmp_path / ".cache" / "datagen" / "compile"

    args = _args()

    (mount,) = _cache_mounts(args)
    assert mount["Source"] == str(tmp_path / ".cache" / "datagen" / "compile") and not mount["ReadOnly"]
    assert (tmp_path / ".cache" / "datagen" / "compile").is_dir()  # made by the host user, before docker would
    assert args["environment"]["TORCHINDUCTOR_CACHE_DIR"] == f"{COMPILE_CACHE_PATH}/torchinductor"
    assert args["environment"]["VLLM_CACHE_ROOT"] == f"{COMPILE_CACHE_PATH}/vllm"
    assert args["environment"]["TRITON_CACHE_DIR"] == f"{COMPILE_CACHE_PATH}/triton"


def test_a_folder_named_is_used_and_a_steps_own_setting_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("DATAGEN_COMPILE_CACHE", str(tmp_path / "kernels"))

    args = _args(env={"VLLM_CACHE_ROOT": "/elsewhere"})

    (mount,) = _cache_mounts(args)
    assert Path(mount["Source"]) == tmp_path / "kernels"
    assert args["environment"]["VLLM_CACHE_ROOT"] == "/elsewhere"
    assert args["environment"]["TORCHINDUCTOR_CACHE_DIR"] == f"{COMPILE_CACHE_PATH}/torchinductor"


def test_off_mounts_nothing_and_names_no_cache(monkeypatch):
    monkeypatch.setenv("DATAGEN_COMPILE_CACHE", "off")

    args = _args()

    assert compile_cache() is None
    assert _cache_mounts(args) == []
    assert not {"TORCHINDUCTOR_CACHE_DIR", "VLLM_CACHE_ROOT", "TRITON_CACHE_DIR"} & set(args["environment"])


def test_a_folder_that_cannot_be_made_is_a_clear_error_before_any_container(monkeypatch, tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    monkeypatch.setenv("DATAGEN_COMPILE_CACHE", str(tmp_path / "a-file" / "compile"))

    with pytest.raises(CannotRunHereError, match="compile cache .*a-file/compile cannot be made") as e:
        _args()
    assert "DATAGEN_COMPILE_CACHE" in e.value.hint
