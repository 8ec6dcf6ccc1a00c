"""The user's paths: absolute against the folder the user stands in, before anything is spawned (the servers, the
load generator and a tree's runs start in the install's folder or a tree's, where a relative path names another
file); and every path a verb writes, checked before any work (issue 88): a folder where a file goes, a file where
a folder goes, a folder this process cannot write in, each one line. The code's own files (the workload presets,
the bundled traces) are found from the install."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from harness.cli.args import UsageError


def user_path(text: str | Path) -> Path:
    """A path the user typed, absolute against the folder they stand in: the children fragbench starts (servers, the
    load generator, a tree's run) run in the install's folder, where a relative path would name another file."""
    return Path(os.path.abspath(os.path.expanduser(text)))


def user_workload(name: str) -> str:
    """A workload as the user named it: a preset's name as it is, a file's path made absolute (user_path)."""
    from workloads.spec import preset_names  # imported when a verb calls this: `fragbench --help` loads no yaml

    return name if name in preset_names() or not Path(name).exists() else str(user_path(name))


def unwritable(path: Path, kind: str) -> str | None:
    """Why `path` cannot take the `kind` ("file" or "folder") a verb will write there, in words that name `path`;
    None where it can. The nearest folder that exists (the rest is made on the way) is tried with a file made and
    removed at once: permission bits say nothing to root, nor of a read-only or virtual file system."""
    if kind == "file" and path.is_dir():
        return f"{path} is a folder, not a file"
    there = path if kind == "folder" else path.parent
    while not there.exists() and there.parent != there:
        there = there.parent
    if not there.is_dir():
        return f"{path}: {there} is a file, not a folder"
    try:
        with tempfile.TemporaryFile(dir=there):
            pass
    except OSError as e:
        return f"{path}: {there} cannot be written ({e.strerror or e})"
    if kind == "file" and path.exists() and not os.access(path, os.W_OK):
        return f"{path} cannot be written (permission denied)"
    return None


def writable_file(path: Path, flag: str) -> Path:
    """`path`, where a verb writes a file; its refusal, one line naming `flag`."""
    if why := unwritable(Path(path), "file"):
        raise UsageError(f"{flag} {why}")
    return Path(path)


def writable_folder(path: Path, flag: str) -> Path:
    """`path`, a folder a verb writes into (made where it is missing); its refusal, one line naming `flag`."""
    if why := unwritable(Path(path), "folder"):
        raise UsageError(f"{flag} {why}")
    return Path(path)


def file_out(text: str) -> str:
    """argparse's type of a flag naming a file the verb writes: refused as it is parsed, before any work."""
    if why := unwritable(Path(text), "file"):
        raise argparse.ArgumentTypeError(why)
    return text


def folder_out(text: str) -> str:
    """argparse's type of a flag naming a folder the verb writes into: refused as it is parsed, before any work."""
    if why := unwritable(Path(text), "folder"):
        raise argparse.ArgumentTypeError(why)
    return text
