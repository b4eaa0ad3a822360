"""DeepSpeed's just-in-time ops build in one folder per Python environment (extensions_dir);
tests/test_offline_kit.py checks it with a second, real environment."""

from __future__ import annotations

import sys
from pathlib import Path

from torch.utils.cpp_extension import get_default_build_root

from ssl_vit.engine.distributed import extensions_dir


def test_each_environment_builds_in_its_own_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "env_a"))
    a = extensions_dir()
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "env_b"))
    b = extensions_dir()
    assert a != b and a.parent == b.parent == Path(get_default_build_root())
    assert a.name.startswith(f"py{sys.version_info.major}{sys.version_info.minor}_")
    (tmp_path / "link").symlink_to(tmp_path / "env_a")
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "link"))
    assert extensions_dir() == a  # the same environment, however it is reached


def test_a_folder_the_user_chose_wins(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ops"))
    assert extensions_dir() == tmp_path / "ops"
