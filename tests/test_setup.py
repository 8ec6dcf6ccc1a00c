"""`make setup` on a box that already holds packages, read on a CPU: scripts/setup_missing.py's plan against a
faked environment and a folder of hand-made wheels, its stops, and what the Makefile runs on each kind of box.
(A whole run on a simulated GPU box, a venv over a folder holding torch and transformers 5.17, is in the
issue 59 closing note: it needs minutes and a wheel download, not a unit test's.)"""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import scripts.setup_missing as setup
from tests.conftest import ROOT


def wheel(folder: Path, name: str, version: str, *requires: str) -> Path:
    """A wheel pip could read: its METADATA, nothing else."""
    path = folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)])
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name.replace('-', '_')}-{version}.dist-info/METADATA", meta)
    return path


def reqs(*texts: str) -> list[Requirement]:
    return [Requirement(t) for t in texts]


def test_what_the_environment_satisfies_is_never_planned_and_the_rest_comes_from_the_wheels(tmp_path):
    """The box's torch 2.11 and transformers 5.17 satisfy the bounds: kept. pydantic comes from its wheel; the
    dependency that wheel names and the box lacks is found too."""
    wheel(tmp_path, "pydantic", "2.5.0", "annotated-types>=0.4", "typing-extensions>=4.6")
    wheel(tmp_path, "annotated-types", "0.7.0")
    have = {"torch": "2.11.0+cu130", "transformers": "5.17.0", "typing-extensions": "4.12.0"}
    got = setup.plan(reqs("torch>=2.4", "transformers>=5.17,<6", "pydantic>=2"), have, setup.wheels_in(tmp_path))
    assert [str(r) for r in got.install] == ["pydantic>=2"] and got.missing == []


def test_offline_every_requirement_no_wheel_satisfies_is_named_dependencies_included(tmp_path):
    wheel(tmp_path, "locust", "2.30.0", "gevent>=24", "flask>=2; python_version >= '3.8'", "pywin32; os_name == 'nt'")
    wheel(tmp_path, "pydantic", "1.10.0")  # too old for the bound
    got = setup.plan(reqs("locust", "pydantic>=2", "plotly"), {}, setup.wheels_in(tmp_path))
    assert got.missing == ["pydantic>=2", "plotly", "gevent>=24", "flask>=2; python_version >= \"3.8\""]
    assert [str(r) for r in got.install] == ["locust"]  # pywin32 is Windows's alone


def test_a_pin_is_checked_without_its_dependencies(tmp_path):
    wheel(tmp_path, "apache-otava", "0.8.0", "google-cloud-bigquery")
    got = setup.plan(reqs("apache-otava==0.8.0"), {}, setup.wheels_in(tmp_path), follow=False)
    assert [str(r) for r in got.install] == ["apache-otava==0.8.0"] and got.missing == []


@pytest.fixture
def pip_calls(monkeypatch) -> list[list[str]]:
    calls: list[list[str]] = []
    monkeypatch.setattr(setup, "pip", lambda args, wheels: calls.append(args))
    return calls


def test_an_offline_set_up_that_lacks_wheels_stops_in_one_line_before_installing_anything(tmp_path, pip_calls,
                                                                                         monkeypatch, capsys):
    monkeypatch.setattr(setup, "installed", lambda: {"torch": "2.11.0"})
    assert setup.main(["--wheels", str(tmp_path), "--pin", "apache-otava==0.8.0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pydantic>=2" in err[0] and "locust" in err[0] and "apache-otava==0.8.0" in err[0]
    assert "torch" not in err[0] and pip_calls == []  # the box's torch satisfies its bound; nothing installed


def test_a_folder_that_is_not_one_is_bad_input(tmp_path, capsys):
    assert setup.main(["--wheels", str(tmp_path / "absent")]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


@pytest.mark.parametrize("seen, expected", [
    (("2.11.0+cu130", "13.0", True, "/usr/lib/python3/dist-packages/torch/__init__.py"), None),
    (("2.13.0+cpu", None, False, "/usr/lib/python3/dist-packages/torch/__init__.py"), "--ignore-installed"),
    (None, "torch==2.13.0"),
])
def test_a_working_cuda_torch_is_kept_and_only_a_missing_or_cpu_one_is_installed(seen, expected, pip_calls,
                                                                                 monkeypatch):
    answers = [seen, ("2.13.0", "13.0", True, "/venv/torch/__init__.py")]
    monkeypatch.setattr(setup, "torch_seen", lambda: answers.pop(0))
    setup.ensure_cuda_torch("2.13.0", None)
    if expected is None:
        assert pip_calls == []  # no torch download on a box whose torch works
    else:
        [call] = pip_calls
        assert "--isolated" in call and expected in call and "torch==2.13.0" in call
        assert "--force-reinstall" not in call  # the system's torch is shadowed in the venv, never replaced


def test_offline_a_cpu_torch_without_a_cuda_wheel_stops_before_pip(tmp_path, pip_calls, monkeypatch):
    monkeypatch.setattr(setup, "torch_seen", lambda: ("2.13.0+cpu", None, False, "/usr/torch/__init__.py"))
    with pytest.raises(setup.Stop, match="no wheel in .* satisfies torch==2.13.0"):
        setup.ensure_cuda_torch("2.13.0", tmp_path)
    assert pip_calls == []


NGC_TORCH = ("2.6.0a0+ecf3bae40a.nv25.1", "12.8", True, "/usr/local/lib/python3.12/dist-packages/torch/__init__.py")


def test_an_ngc_pre_release_torch_at_the_floor_is_kept_and_never_planned(pip_calls, monkeypatch, capsys):
    """NGC 25.01's torch is `2.6.0a0+<hash>.nv25.1`, a pre-release sorting below 2.6: kept by ensure_cuda_torch,
    it must not then be asked of pip by the plan (`torch>=2.6` read against the full version)."""
    monkeypatch.setattr(setup, "torch_seen", lambda: NGC_TORCH)
    monkeypatch.setattr(setup, "installed", lambda: {"torch": NGC_TORCH[0], "numpy": "1.26.4"})
    assert setup.main(["--cuda-torch", "2.13.0", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"torch {NGC_TORCH[0]} (CUDA 12.8)" in out and "kept" in out
    [planned] = [x for x in out.splitlines() if "to install" in x]
    assert "pydantic>=2" in planned and "torch" not in planned and pip_calls == []
    assert setup.plan(reqs("torch>=2.6"), {"torch": NGC_TORCH[0]}, None).install == []
    assert [str(r) for r in setup.plan(reqs("torch>=2.6"), {"torch": "2.5.0a0+x.nv24.10"}, None).install] == [
        "torch>=2.6"]  # below the floor whatever its suffix


def test_an_install_that_leaves_torch_without_cuda_stops_in_one_line(pip_calls, monkeypatch, capsys):
    """A dependency's own torch bound can have pip put PyPI's torch over the image's; one built for a newer CUDA
    than the driver sees no GPU (`--device auto` would fall to the CPU). CUDA is checked again after the install,
    and the set-up stops before the pins and the project."""
    answers = [NGC_TORCH, ("2.13.0+cu130", "13.0", False, "/w/.venv/lib/python3.12/site-packages/torch/__init__.py")]
    monkeypatch.setattr(setup, "torch_seen", lambda: answers.pop(0))
    monkeypatch.setattr(setup, "installed", lambda: {"torch": NGC_TORCH[0]})
    assert setup.main(["--cuda-torch", "2.13.0", "--pin", "apache-otava==0.8.0"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "2.13.0+cu130" in err[0] and "sees no GPU" in err[0]
    assert len(pip_calls) == 1 and "--no-deps" not in pip_calls[0] and answers == []


def test_an_install_that_keeps_a_cuda_torch_goes_on(pip_calls, monkeypatch):
    answers = [NGC_TORCH, NGC_TORCH]
    monkeypatch.setattr(setup, "torch_seen", lambda: answers.pop(0))
    monkeypatch.setattr(setup, "installed", lambda: {"torch": NGC_TORCH[0]})
    assert setup.main(["--cuda-torch", "2.13.0", "--pin", "apache-otava==0.8.0"]) == 0
    assert len(pip_calls) == 3 and answers == []


def make_n(*args: str) -> list[str]:
    # --no-print-directory: under `make test` this make is a sub-make, which otherwise prints its directory lines
    out = subprocess.run(["make", "--no-print-directory", "-n", "-W", "pyproject.toml", "setup", *args], cwd=ROOT,
                         capture_output=True, text=True).stdout
    return out.replace("\\\n", " ").splitlines()


def test_on_a_gpu_box_the_venv_sees_the_systems_packages_and_nothing_forces_a_torch():
    lines = make_n("DEVICE_KIND=cuda")
    assert any("-m venv --system-site-packages" in x for x in lines)
    assert not any("pip install" in x for x in lines)  # only setup_missing.py installs, and only what is missing
    assert any("setup_missing.py --cuda-torch 2.13.0" in x for x in lines) and lines[-1].endswith("installed-cuda")
    assert any("--wheels '/w'" in x for x in make_n("DEVICE_KIND=cuda", "WHEELS=/w"))


UV = ".venv/bin/uv pip install -q --compile-bytecode --python .venv/bin/python"


def test_on_a_laptop_uv_installs_the_tested_torch_and_the_project_from_pips_folders_of_wheels():
    lines = make_n("DEVICE_KIND=cpu", "PIP_FIND_LINKS=/w1 /w2")
    links = "--find-links /w1 --find-links /w2"
    assert [x for x in lines if "pip install" in x] == [
        ".venv/bin/pip install -q uv", f"{UV} {links} torch==2.13.0", f"{UV} {links} -e '.[dev]'",
        f"{UV} {links} --no-deps apache-otava==0.8.0"]
    assert not any("--system-site-packages" in x for x in lines)


def test_make_test_on_a_gpu_or_offline_box_installs_nothing_it_cannot_have():
    """On the laptop make test installs the ray extra once, under its own stamp (no editable reinstall each run);
    elsewhere ray alone, and its failure (no network, no wheel) leaves simulate --ray's tests to skip, unstamped,
    instead of stopping the suite."""
    def lines(*args):
        # -W pyproject.toml: the ray stamp out of date, as on a fresh clone, whatever this checkout's venv holds
        out = subprocess.run(["make", "--no-print-directory", "-n", "-o", "setup", "-W", "pyproject.toml", "test",
                              *args], cwd=ROOT, capture_output=True, text=True).stdout
        return [x for x in out.replace("\\\n", " ").splitlines() if "pip install" in x or "fragbench-ray" in x]

    assert lines("DEVICE_KIND=cpu", "PIP_FIND_LINKS=/w") == [f"{UV} --find-links /w 'ray>=2.9'",
                                                            "touch .venv/.fragbench-ray"]
    [gpu] = lines("DEVICE_KIND=cuda", "WHEELS=/w")
    assert "--no-index --find-links '/w' 'ray>=2.9' && touch .venv/.fragbench-ray" in gpu and "|| echo" in gpu


def test_make_tests_ray_is_the_ray_extra_and_installed_once():
    extra = setup.tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["ray"]
    assert extra == ["ray>=2.9"]  # the bound make test installs (RAY in the Makefile)
    once = subprocess.run(["make", "--no-print-directory", "-n", "-o", "setup", "-o", ".venv/.fragbench-ray", "test",
                           "DEVICE_KIND=cpu"], cwd=ROOT, capture_output=True, text=True).stdout
    assert "pip install" not in once  # a venv that has it: nothing installed before the suite


def registry_answers() -> bool:
    """Whether pip can fetch from the package index here (a small wheel, within a minute)."""
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d",
                            tmp, "wheel"], capture_output=True, timeout=120)
    return r.returncode == 0


def isolates_network() -> bool:
    """Whether `unshare -n` (a network namespace of its own: root, or a kernel that allows it) runs here."""
    import shutil

    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0


@pytest.mark.slow  # a folder of wheels filled and a set-up from it: make test-all
@pytest.mark.offline_setup
@pytest.mark.timeout(900)
def test_make_wheels_fills_a_folder_that_make_setup_installs_from_with_the_network_off(tmp_path):
    """Where the registry answers, `make wheels WHEELS=DIR` fills the folder; then, with no network at all (unshare
    -n) and no pip configuration (its find-links folder would add wheels the folder lacks), `make setup
    WHEELS=DIR` in a copy of this tree sets up. `pip download` of the requirements alone left out `wheel`, and set-up
    stopped on it. About 45 s to fill (network) and 100 s to set up on the 2-core CI machine: pip installs some 100
    wheels, torch's among them. That set-up's pip writes no bytecode (PIP_COMPILE=0, pip's --no-compile: a venv that
    runs one import and is thrown away has no use for it; what is installed, and from where, is the same): 62 s to
    set up where it took 81 s on the 2-core machine (PIP_NO_COMPILE=1 would not do: pip reads a --no-* option's
    variable as the value of what it negates)."""
    import os
    import shutil

    if not isolates_network():
        pytest.skip("unshare -n is not available here (it needs root or user namespaces)")
    if not registry_answers():
        pytest.skip("the package registry does not answer here: nothing to fill a folder from")
    wheels, tree = tmp_path / "wheels", tmp_path / "tree"
    r = subprocess.run(["make", "--no-print-directory", "wheels", f"WHEELS={wheels}"], cwd=ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    names = {p.name.split("-")[0].lower() for p in wheels.glob("*.whl")}
    assert {"torch", "transformers", "setuptools", "wheel", "apache_otava", "pytest"} <= names, sorted(names)
    shutil.copytree(ROOT, tree, ignore=shutil.ignore_patterns(".git", ".venv*", "models", "results", "reports",
                                                              "__pycache__", ".pytest_cache", "gpu-check*"))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "UV_", "VIRTUAL_ENV"))}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_COMPILE="0", DEVICE_KIND="cpu")
    r = subprocess.run(["unshare", "-n", "make", "--no-print-directory", "setup", f"WHEELS={wheels}"], cwd=tree,
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    v = subprocess.run([str(tree / ".venv" / "bin" / "python"), "-c",
                        "import torch, transformers, otava, engines; print(torch.__version__)"], cwd=tree,
                       capture_output=True, text=True)
    assert v.returncode == 0 and v.stdout.strip().startswith("2.13.0"), v.stderr[-1000:]
    assert list((tree / ".venv").glob(".fragbench-installed-cpu"))


def test_make_wheels_without_a_folder_is_bad_input_in_one_line():
    r = subprocess.run(["make", "--no-print-directory", "-s", "wheels"], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip().splitlines()[0] == \
        "make wheels: error: name the folder: make wheels WHEELS=DIR"
