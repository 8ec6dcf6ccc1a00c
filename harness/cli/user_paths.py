"""The user's paths: absolute against the folder the user stands in, before anything is spawned (the servers, the
load generator and a tree's runs start in the install's folder or a tree's, where a relative path names another
file). The code's own files (the workload presets, the bundled traces) are found from the install."""

from __future__ import annotations

import os
from pathlib import Path


def user_path(text: str | Path) -> Path:
    """A path the user typed, absolute against the folder they stand in: the children fragbench starts (servers, the
    load generator, a tree's run) run in the install's folder, where a relative path would name another file."""
    return Path(os.path.abspath(os.path.expanduser(text)))


def user_workload(name: str) -> str:
    """A workload as the user named it: a preset's name as it is, a file's path made absolute (user_path)."""
    from workloads.spec import preset_names  # imported when a verb calls this: `fragbench --help` loads no yaml

    return name if name in preset_names() or not Path(name).exists() else str(user_path(name))
