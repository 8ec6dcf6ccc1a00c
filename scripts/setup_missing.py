"""`make setup` where the environment already holds packages (a GPU box's CUDA torch, a container's stack) or has
no network: what fragbench needs and this interpreter lacks, installed alone.

    .venv/bin/python scripts/setup_missing.py [--wheels DIR] [--cuda-torch VERSION] [--pin REQ ...] [--dry-run]
    python3 scripts/setup_missing.py --requirements resolved|pinned [--pin REQ ...]   (make wheels)

The needs: pyproject.toml's dependencies, its dev extra and its build backend, and each --pin (installed without
its dependencies, as Otava is). Each is checked against what the interpreter sees: its venv and, in a venv made with
--system-site-packages, the system's. What is satisfied is never touched (no upgrade, no reinstall), so the box's
torch stays; pip installs into the venv only, so the system's packages are as they were whatever happens; and a
run after a failure finds again only what is still missing. With --wheels every install is offline (pip
--no-index --find-links DIR), and the whole plan is checked before anything is installed: what neither the
environment nor a wheel in DIR satisfies (dependencies of those wheels included) stops the set-up in one line
that names every one. --cuda-torch VERSION: the torch seen must have CUDA and see the GPU; where it does not (or
there is none), that torch version is installed and checked once more; and after pip has installed what was
missing the torch seen is checked again (a dependency must not have replaced it with one that lacks CUDA).
Exit 0 when set up, 1 at a stop (one line on stderr), 2 on bad input.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import zipfile
from dataclasses import dataclass, field
from email.parser import Parser
from importlib import metadata
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: pip's own copy of tomli reads the same
    from pip._vendor import tomli as tomllib
try:
    from packaging.requirements import Requirement
    from packaging.tags import sys_tags
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import InvalidVersion, Version
except ModuleNotFoundError:  # a bare venv has no packaging yet: pip's own copy is the same library
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.tags import sys_tags
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import InvalidVersion, Version

ROOT = Path(__file__).resolve().parents[1]
TORCH_PROBE = ("import json, torch; print(json.dumps([torch.__version__, torch.version.cuda, "
               "torch.cuda.is_available(), torch.__file__]))")


class Stop(Exception):
    """A set-up that cannot go on: its one line."""


@dataclass(frozen=True)
class Wheel:
    name: str
    version: str
    path: Path
    requires: tuple[str, ...]


@dataclass
class Plan:
    install: list[Requirement] = field(default_factory=list)  # what pip is asked for (their dependencies follow)
    missing: list[str] = field(default_factory=list)  # what no source satisfies


def needs(pyproject: Path, extras: list[str]) -> list[Requirement]:
    data = tomllib.loads(pyproject.read_text())
    project = data["project"]
    texts = [*project["dependencies"], *data.get("build-system", {}).get("requires", [])]
    for extra in extras:
        texts += project.get("optional-dependencies", {}).get(extra, [])
    return [Requirement(t) for t in texts]


def installed() -> dict[str, str]:
    """Every distribution the interpreter sees, by name: the first on sys.path, the one that imports."""
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out.setdefault(canonicalize_name(name), dist.version)
    return out


def wheels_in(folder: Path) -> dict[str, list[Wheel]]:
    """The wheels in `folder` this interpreter can install, by name, newest first (their metadata read)."""
    tags = set(sys_tags())
    out: dict[str, list[Wheel]] = {}
    for path in sorted(folder.glob("*.whl")):
        try:
            name, version, _, file_tags = parse_wheel_filename(path.name)
        except ValueError:
            continue
        if not tags & set(file_tags):
            continue
        with zipfile.ZipFile(path) as z:
            meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            requires = Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []
        out.setdefault(name, []).append(Wheel(name, str(version), path, tuple(requires)))
    for found in out.values():
        found.sort(key=lambda w: parse_wheel_filename(w.path.name)[1], reverse=True)
    return out


def applies(req: Requirement, extras: frozenset[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({"extra": e}) for e in (extras or {""}))


def satisfies(req: Requirement, version: str) -> bool:
    """Whether an installed `version` meets `req`: the full version, or its release alone. An image's build of a
    release is that release: NGC's torch `2.6.0a0+<hash>.nv25.1` is a pre-release that sorts below 2.6, and read
    whole it would fail `torch>=2.6` and have pip put PyPI's torch over the image's tuned CUDA build. The one rule
    for every requirement and for the kept CUDA torch alike."""
    if req.specifier.contains(version, prereleases=True):
        return True
    try:
        return req.specifier.contains(Version(version).base_version, prereleases=True)
    except InvalidVersion:  # a legacy version string: only the whole of it could have matched
        return False


def plan(wanted: list[Requirement], have: dict[str, str], wheels: dict[str, list[Wheel]] | None,
         follow: bool = True) -> Plan:
    """What to ask pip for, and (offline) what nothing satisfies: `wanted` against the environment, then (where
    `follow`) each wheel that would be installed against the environment and the wheels, down to the last
    dependency."""
    out, seen = Plan(), set()
    queue = [(req, frozenset(), True) for req in wanted]
    while queue:
        req, extras, top = queue.pop(0)
        name = canonicalize_name(req.name)
        key = (name, str(req.specifier), frozenset(req.extras))
        if key in seen or not applies(req, extras):
            continue
        seen.add(key)
        if name in have and satisfies(req, have[name]):
            continue
        if wheels is None:  # from the index: pip resolves the dependencies itself
            out.install.append(req)
            continue
        wheel = next((w for w in wheels.get(name, []) if req.specifier.contains(w.version, prereleases=True)), None)
        if wheel is None:
            out.missing.append(str(req))
            continue
        if top:
            out.install.append(req)
        if follow:
            queue += [(Requirement(r), frozenset(req.extras), False) for r in wheel.requires]
    return out


def pip(args: list[str], wheels: Path | None) -> None:
    offline = ["--no-index", "--find-links", str(wheels)] if wheels else []
    cmd = [sys.executable, "-m", "pip", "install", "-q", *offline, *args]
    print("make setup:", " ".join(cmd[1:]), flush=True)
    if subprocess.run(cmd).returncode != 0:
        raise Stop(f"pip could not install {' '.join(a for a in args if not a.startswith('-'))} (its error above); "
                   "what was installed before it stays, and the next make setup retries only what is missing")


def torch_seen() -> tuple[str, str | None, bool, str] | None:
    """(version, CUDA version or None, whether it sees a GPU, where it lies) of the torch this interpreter
    imports, asked in a child (a broken torch must not take the set-up with it); None where there is none."""
    r = subprocess.run([sys.executable, "-c", TORCH_PROBE], capture_output=True, text=True)
    return tuple(json.loads(r.stdout.splitlines()[-1])) if r.returncode == 0 else None


def ensure_cuda_torch(version: str, wheels: Path | None) -> str:
    """The environment's torch where it has CUDA, sees the GPU and is within pyproject.toml's floor (kept: no
    download; an image's torch 2.4 or 2.5 is not: every engine would fail at model load); else `version`, installed
    here (isolated from pip's configuration: a find-links folder's CPU wheel of the same version must not
    shadow the CUDA build) and checked once more."""
    seen = torch_seen()
    floor = next(r for r in needs(ROOT / "pyproject.toml", []) if r.name == "torch")
    if seen is not None and seen[1] and seen[2]:
        if satisfies(floor, seen[0]):
            return f"torch {seen[0]} (CUDA {seen[1]}) at {seen[3]} kept"
        print(f"make setup: torch {seen[0]} at {seen[3]} is outside pyproject.toml's {floor} (the reasons are "
              f"there): torch {version} goes into the venv beside it", flush=True)
    if wheels and (lacking := plan([Requirement(f"torch=={version}")], {}, wheels_in(wheels), follow=False).missing):
        raise Stop(f"the environment's torch has no CUDA (or sees no GPU, or is outside {floor}) and no wheel in "
                   f"{wheels} satisfies {lacking[0]}: put its CUDA wheel there (nothing was installed)")
    # a torch without CUDA in the venv is replaced; one outside it (the system's) is shadowed, never touched
    in_venv = seen is not None and Path(seen[3]).resolve().is_relative_to(Path(sys.prefix).resolve())
    over = [] if seen is None else ["--force-reinstall"] if in_venv else ["--ignore-installed"]
    pip(["--isolated", *over, f"torch=={version}"], wheels)
    seen = torch_seen()
    if seen is None or not seen[1]:
        raise Stop(f"torch {seen[0] if seen else version} has no CUDA build: install torch=={version} with CUDA "
                   "for this driver (WHEELS=DIR: put its CUDA wheel there)")
    if not seen[2]:
        raise Stop(f"torch {seen[0]} (CUDA {seen[1]}) sees no GPU: is the driver (nvidia-smi) older than this CUDA?")
    return f"torch {seen[0]} (CUDA {seen[1]}) installed"


def wanted_for_wheels(pins: list[str]) -> tuple[list[str], list[str]]:
    """What a folder of wheels must hold for `make setup WHEELS=DIR` (`make wheels` fills one): pyproject.toml's
    dependencies, its dev extra and its build backend, and `wheel` (a fresh venv's setuptools before 70.1 builds
    the editable install with it), resolved with their dependencies; and the pins, without theirs."""
    return [*(str(r) for r in needs(ROOT / "pyproject.toml", ["dev"])), "wheel"], pins


def set_up(args) -> None:
    wheels = Path(args.wheels) if args.wheels else None
    if args.cuda_torch:
        print(f"make setup: {ensure_cuda_torch(args.cuda_torch, wheels)}", flush=True)
    wanted = needs(ROOT / "pyproject.toml", ["dev"])
    have = installed()
    if "setuptools" in have and Version(have["setuptools"]) < Version("70.1"):
        wanted.append(Requirement("wheel"))  # setuptools before 70.1 builds an editable install with it
    found = wheels_in(wheels) if wheels else None
    # a pin is installed without its dependencies: its own wheel is all it needs
    todo, pinned = plan(wanted, have, found), plan([Requirement(p) for p in args.pin], have, found, follow=False)
    missing = todo.missing + pinned.missing
    if missing:
        raise Stop(f"no wheel in {wheels} (nor the environment) satisfies: {', '.join(missing)}; add them and run "
                   "make setup WHEELS=DIR again (nothing was installed)")
    shown = ", ".join(str(r) for r in todo.install + pinned.install) or "nothing"
    print(f"make setup: missing here, to install{' offline' if wheels else ''}: {shown}", flush=True)
    if args.dry_run:
        return
    if todo.install:
        pip([str(r) for r in todo.install], wheels)
        if args.cuda_torch:
            check_cuda_kept(todo.install)
    if pinned.install:
        pip(["--no-deps", *(str(r) for r in pinned.install)], wheels)
    pip(["--no-deps", "--no-build-isolation", "-e", str(ROOT)], wheels)  # fragbench itself: nothing to fetch


def check_cuda_kept(installed_now: list[Requirement]) -> None:
    """After pip has resolved `installed_now` with their dependencies, the torch the interpreter imports must still
    have CUDA and see the GPU: a dependency's own torch bound (or pip reading an image's build differently) can put
    PyPI's torch over the one ensure_cuda_torch kept, and a torch built for a newer CUDA than the driver sees no
    GPU, so `--device auto` would fall to the CPU. (The pins go in with --no-deps: they cannot bring a torch.)"""
    seen = torch_seen()
    if seen is not None and seen[1] and seen[2]:
        return
    what = "no torch imports" if seen is None else (
        f"torch is now {seen[0]} at {seen[3]}, " + ("which sees no GPU" if seen[1] else "a build without CUDA"))
    raise Stop(f"installing {', '.join(str(r) for r in installed_now)} left no CUDA torch in view ({what}; pip's "
               "output above names what asked for it): nothing outside the venv was touched, so .venv/bin/pip "
               "uninstall -y torch brings the box's back into view")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="install what fragbench needs and this environment lacks")
    ap.add_argument("--wheels", help="install offline from this folder of wheels (default: none, from the index)")
    ap.add_argument("--cuda-torch", metavar="VERSION", help="require a CUDA torch that sees the GPU; install this "
                    "version where there is none (default: none, torch is one more requirement)")
    ap.add_argument("--pin", action="append", default=[],
                    help="a requirement installed without its dependencies, repeatable (default: none)")
    ap.add_argument("--dry-run", action="store_true", help="say what would be installed, install nothing "
                    "(default: off)")
    ap.add_argument("--requirements", choices=("resolved", "pinned"), default=None,
                    help="print what a folder of wheels for set-up must hold, one a line, and install nothing: the "
                    "requirements resolved with their dependencies, or the pins alone (make wheels; default: off)")
    args = ap.parse_args(argv)
    if args.requirements:
        resolved, pinned = wanted_for_wheels(args.pin)
        print("\n".join(resolved if args.requirements == "resolved" else pinned))
        return 0
    if args.wheels and not Path(args.wheels).is_dir():
        print(f"make setup: error: WHEELS={args.wheels} is not a folder", file=sys.stderr)
        return 2
    try:
        set_up(args)
    except Stop as e:
        print(f"make setup: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
