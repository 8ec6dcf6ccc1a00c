"""The two builds an A/B compares, each as a work tree and the Python that runs it: a revision of the repository the
user stands in (the git repository of the working directory, else this install's checkout) becomes a git work tree
beside that repository's (`.ab/trees/SHA`, ignored by git, kept for the next night), a directory that is a git work
tree is taken as it is, and NEW defaults to that repository's working tree, built as BASE is: its HEAD's tree where
it is clean, else a snapshot of it (a commit of its files as they stand, untracked ones git does not ignore
included), checked out the same way (docs/method.md, Nightly). A tree shares this venv where its
pyproject.toml is the same bytes as the checkout's (its dependencies are then equal; the tree's own code comes first
on the import path, PYTHONPATH, ahead of the venv's editable install of this checkout); otherwise `make setup` gives
it its own venv."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engines.procs import spawn, stop

ROOT = Path(__file__).resolve().parents[2]  # this install's checkout: its code, and the repository outside any other
TREES: Path | None = None  # where revisions' work trees go; None: .ab/trees in the user's repository
KEPT_TREES = 3  # revisions' work trees kept for the next nights (each a checkout of the repository's files)
SETUP_TIMEOUT_S = 900  # a fresh venv on this 2-core machine: 60-100 s with uv, pip's 150-175 s; a slow night x5


class TreeError(Exception):
    """A revision that does not resolve, or a tree that cannot be set up: one line for the user."""


@dataclass(frozen=True)
class Tree:
    label: str  # what the user named: a revision or a path ("working tree" for the checkout)
    path: Path
    sha: str | None  # the commit it is of; None for a directory taken as it stands (it may hold changes)
    python: str  # the interpreter that runs this tree's code
    dirty: bool = False  # a working tree that differed from `sha`: `snapshot` holds what it held
    snapshot: str | None = None  # the snapshot's commit, checked out at `path` (a dirty working tree's)

    def env(self) -> dict[str, str]:
        """The environment a child of this tree runs in: its own code first on the import path."""
        return {**os.environ, "PYTHONPATH": str(self.path)}


def repository() -> Path:
    """The fragbench repository the user stands in (git's top of the working directory, where it holds harness/),
    else this install's checkout: `memory-gate HEAD` in a second clone is that clone's HEAD."""
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True, text=True)
    except OSError:  # no git at all: the install's checkout, whose git calls then say so
        return ROOT
    top = Path(out.stdout.strip()) if out.returncode == 0 and out.stdout.strip() else None
    return top.resolve() if top is not None and (top / "harness").is_dir() else ROOT


def trees_dir() -> Path:
    return TREES if TREES is not None else repository() / ".ab" / "trees"


def git(*args: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    out = subprocess.run(["git", *args], cwd=cwd or repository(), capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise TreeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"git {args[0]} failed")
    return out.stdout.strip()


def resolve(rev: str) -> str:
    """The commit a revision names, or a TreeError naming it."""
    try:
        return git("rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    except TreeError:
        pass
    # a CI's clone of depth 1 holds HEAD alone: the nightly's HEAD~1 is not there, which the user can fix
    shallow = git("rev-parse", "--is-shallow-repository") == "true"
    raise TreeError(f"unknown revision {rev!r} (not a commit of {repository()}" + (
        "; a shallow clone: fetch the history it needs, `git fetch --deepen=1`, or clone without --depth)"
        if shallow else ")"))


def tree_of(name: str | None) -> Tree:
    """NEW or BASE as the user named it: None is this checkout's working tree, built as a revision is (working_tree),
    an existing directory is a work tree as it stands, anything else a revision checked out beside the checkout."""
    if name is None:
        return working_tree()
    path = Path(name)
    if path.is_dir():
        try:
            top = Path(git("rev-parse", "--show-toplevel", cwd=path.resolve()))
        except TreeError as e:
            raise TreeError(f"{name}: not a git work tree ({e})") from None
        if not (top / "harness").is_dir():
            raise TreeError(f"{name}: not a fragbench work tree (no harness/ at {top})")
        return Tree(name, top, None, python_for(top))
    sha = resolve(name)
    path = checkout(sha)
    return Tree(name, path, sha, python_for(path))


def working_tree() -> Tree:
    """The user's working tree as NEW, served as BASE is: from a tree of its own under .ab/trees, through PYTHONPATH
    (a build run from the checkout itself ran beside its own bytecode and the editable install, BASE from a fresh
    tree, and every A/A night leaned one way, issue 87). Clean: its HEAD's tree, BASE's own in an A/A run. Dirty: a
    snapshot of it, made once per distinct content and reused."""
    here = repository()
    head = git("rev-parse", "HEAD", cwd=here)
    dirty = bool(git("status", "--porcelain", cwd=here))
    shot = snapshot(here, head) if dirty else None
    path = checkout(shot or head)
    return Tree("working tree", path, head, python_for(path), dirty, shot)


# the snapshot's author and dates fixed: the same files on the same HEAD make the same commit, and so reuse its tree
SNAPSHOT_ENV = {"GIT_AUTHOR_NAME": "fragbench ab", "GIT_AUTHOR_EMAIL": "ab@fragbench", "GIT_AUTHOR_DATE": "@0 +0000",
                "GIT_COMMITTER_NAME": "fragbench ab", "GIT_COMMITTER_EMAIL": "ab@fragbench",
                "GIT_COMMITTER_DATE": "@0 +0000"}


def snapshot(top: Path, head: str) -> str:
    """A commit of the work tree `top` as it stands on `head` (tracked files with their changes, untracked ones git
    does not ignore), written through a copy of its index: the user's index, stash and branches are left as they
    are. No ref names it; the tree checked out from it keeps it from git's gc."""
    with tempfile.TemporaryDirectory() as tmp:
        index = Path(tmp) / "index"
        own = Path(git("rev-parse", "--path-format=absolute", "--git-path", "index", cwd=top))
        if own.is_file():  # its stat cache: only the changed files are hashed again
            shutil.copyfile(own, index)
        env = {**os.environ, **SNAPSHOT_ENV, "GIT_INDEX_FILE": str(index)}
        git("add", "--all", cwd=top, env=env)
        tree = git("write-tree", cwd=top, env=env)
        return git("commit-tree", tree, "-p", head, "-m", "fragbench ab: the working tree as NEW", cwd=top, env=env)


def identity(tree: Tree) -> dict:
    """What ab.json says a build was: its label, its commit (the working tree's HEAD where it is a checkout) and
    whether its tree differed from that commit (changes or files git does not ignore): a dirty tree is not the
    commit, and is never recorded as a revision that passed; its snapshot, where one was served, is named."""
    if tree.sha is not None:
        sha, dirty = tree.sha, tree.dirty
    else:
        try:
            sha = git("rev-parse", "HEAD", cwd=tree.path)
            dirty = bool(git("status", "--porcelain", cwd=tree.path))
        except TreeError:  # a directory without a commit yet: no revision to name
            sha, dirty = None, True
    return {"label": tree.label, "path": str(tree.path), "sha": sha, "dirty": dirty, "snapshot": tree.snapshot}


def checkout(sha: str) -> Path:
    """A work tree of the commit at .ab/trees/SHA (made once, reused while it still holds that commit)."""
    trees = trees_dir()
    path = trees / sha[:12]
    if path.is_dir():
        try:
            if git("rev-parse", "HEAD", cwd=path) == sha:
                path.touch()  # in use again: drop_old, which goes by age, keeps it (a night's BASE is NEW's old tree)
                return path
        except TreeError:
            pass
        git("worktree", "remove", "--force", str(path))
    git("worktree", "prune")
    trees.mkdir(parents=True, exist_ok=True)
    git("worktree", "add", "--detach", str(path), sha)
    drop_old(keep=path)
    return path


def drop_old(keep: Path) -> None:
    """The work trees beyond the KEPT_TREES made last removed (a nightly makes one a passing revision): `keep`
    stays."""
    most = KEPT_TREES
    trees = sorted((p for p in trees_dir().iterdir() if p.is_dir() and p != keep), key=lambda p: p.stat().st_mtime)
    for old in trees[: max(0, len(trees) - (most - 1))]:
        try:
            git("worktree", "remove", "--force", str(old))
        except TreeError:
            pass  # not a work tree git knows (removed by hand): left as it is


def python_for(path: Path) -> str:
    """This venv's Python where the tree's dependencies are this checkout's, else the tree's own venv (set up)."""
    if path.resolve() == ROOT or same_dependencies(path):
        return sys.executable
    own = path / ".venv" / "bin" / "python"
    done = run_child(["make", "-C", str(path), "setup"], path, dict(os.environ), SETUP_TIMEOUT_S)
    if done.returncode != 0 or not own.exists():
        raise TreeError(f"{path}: its dependencies differ from this checkout's and `make setup` failed: "
                        f"{done.last_line}")
    return str(own)


@dataclass(frozen=True)
class ChildResult:
    returncode: int | None  # None: stopped at its time limit
    stdout: str
    stderr: str

    @property
    def last_line(self) -> str:
        lines = (self.stderr or self.stdout).strip().splitlines()
        return lines[-1] if lines else f"exit {self.returncode}, no output"


def run_child(cmd: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> ChildResult:
    """A child in a process group of its own that dies with us, stopped whole (its own children too) at the limit
    or when we are interrupted."""
    proc = spawn(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
        return ChildResult(proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        stop(proc)
        return ChildResult(None, "", f"stopped after its limit of {timeout_s:g} s")
    finally:
        if proc.poll() is None:
            stop(proc)


def same_dependencies(path: Path) -> bool:
    mine, theirs = ROOT / "pyproject.toml", path / "pyproject.toml"
    return theirs.is_file() and theirs.read_bytes() == mine.read_bytes()
