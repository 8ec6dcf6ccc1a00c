"""What run.json records of where a run ran: the commit, the versions, the hardware."""

from __future__ import annotations

import platform
import subprocess
from pathlib import Path

import psutil

from engines.memory.cuda import device_info, device_note

ROOT = Path(__file__).resolve().parents[2]


def git_sha() -> str | None:
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], cwd=ROOT, text=True,
                                       stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "aiohttp", "locust", "plotly", "fragbench"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = None
    return out


def hardware(device: str) -> dict:
    return {"machine": platform.machine(), "cpus": psutil.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
            "device": device_note(device), **{f"device_{k}": v for k, v in device_info(device).items()}}
