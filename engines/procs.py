"""Child processes that end with their parent, a free loopback port, Prometheus text as numbers, and the
listening loop every fragbench server runs (the in-house server and a peer's proxy).

The lowest layer that needs these is the engines' (the vLLM peer); the harness imports them from here.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable

from prometheus_client.parser import text_string_to_metric_families

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _die_with_parent() -> None:
    """Runs in the child before exec: the kernel sends it SIGTERM when its parent dies, SIGKILL included."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the parent's own handlers still stop it
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn(cmd: list[str], **kwargs) -> subprocess.Popen:
    """A child in a process group of its own (so `stop` reaches its children too) that dies with us."""
    return subprocess.Popen(cmd, preexec_fn=_die_with_parent, start_new_session=True, **kwargs)


def stop(proc: subprocess.Popen, timeout_s: float = 10.0) -> int | None:
    """SIGTERM to the child's whole group; SIGKILL to what is left of it after timeout_s."""
    _signal_group(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    wait_group_gone(proc.pid, timeout_s)
    return proc.returncode


def wait_group_gone(pgid: int, timeout_s: float = 10.0) -> bool:
    """Wait for every process of a group to exit, SIGKILL the rest at the deadline. False if any had to be."""
    deadline = time.monotonic() + timeout_s
    while group_alive(pgid):
        if time.monotonic() >= deadline:
            _signal_group(pgid, signal.SIGKILL)
            return False
        time.sleep(0.05)
    return True


def kill_tree(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGKILL a child spawned in a group of its own, its group and every process below it, then wait for them:
    a server it started in a session of its own (`spawn`) is below it but not in its group. Our own group is never
    signalled."""
    import psutil

    if proc.poll() is not None:  # exited: what is left of its group goes (a group's id is not reused while it lives)
        _signal_group(proc.pid, signal.SIGKILL)
        return
    try:
        below = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        below = []
    ours = os.getpgrp()
    groups = {proc.pid}
    for p in below:
        with contextlib.suppress(psutil.NoSuchProcess, ProcessLookupError):
            groups.add(os.getpgid(p.pid))
    for pgid in groups - {ours}:
        _signal_group(pgid, signal.SIGKILL)
    for p in below:  # one that left its group for ours still goes
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    proc.wait()
    psutil.wait_procs(below, timeout=timeout_s)
    for pgid in groups - {ours}:
        wait_group_gone(pgid, timeout_s)


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _signal_group(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def exit_on_sigterm() -> None:
    """SIGTERM and SIGHUP become SystemExit in the main thread: `finally` blocks then stop our children."""
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGHUP, handler)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metric_samples(text: str) -> list[tuple[str, dict, float]]:
    """Every sample of a Prometheus text page: (name, labels, value). Raises ValueError on garbage."""
    return [(s.name, s.labels, s.value) for family in text_string_to_metric_families(text) for s in family.samples]


def metric_values(text: str) -> dict[str, float]:
    """Each metric of a Prometheus text page, summed over its labels (one engine, one model)."""
    out: dict[str, float] = {}
    for name, _, value in metric_samples(text):
        out[name] = out.get(name, 0.0) + value
    return out


async def serve_app(app, host: str, port: int, ready: Callable[[int], None]) -> None:
    """Serve an aiohttp app on host:port until cancelled; `ready` gets the bound port (port 0 picks a free one).
    A handler's task is cancelled when its client goes away (the in-house server aborts the request then)."""
    from aiohttp import web  # only the servers need it; the harness imports this module for the rest

    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, host, port)
        await site.start()
        ready(site._server.sockets[0].getsockname()[1])
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


__all__ = ["exit_on_sigterm", "free_port", "group_alive", "metric_samples", "metric_values", "serve_app", "spawn",
           "stop", "wait_group_gone"]
