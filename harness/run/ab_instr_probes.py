"""The A/B gate's instruction-count probe: one tree's engine stepped through fixed batch shapes under valgrind's
callgrind (harness/run/ab_instr_shapes.py, this checkout's copy run with the tree's code first on its import path,
as the memory gate runs its measurement), its instructions read per shape (harness/analysis/ab_instr.py).

How it counts only the shapes: callgrind starts with its instrumentation off (--instr-atstart=no: the child's
imports, the model's load and a warm-up pass run at valgrind's lightest slow-down and are not counted); once the
child says it is ready, `callgrind_control -i on` switches the instrumentation on, and collection is toggled on
entering and off leaving `operator.call` (--toggle-collect on CPython's `_operator_call`, which the child calls once
per shape and nothing else calls), with a dump after each (--dump-after): one file per shape, in order. One thread
(OMP, MKL, OpenBLAS and torch's), a fixed hash seed, and a garbage collection before each shape with none during it:
the same tree on the same inputs executes nearly the same instructions, whatever else runs on the machine (two
plain runs of the tiny model's paged engine here, under a load of 6-13 on 2 cores: every shape within 0.22 %, the
geometric mean within 0.06 %; `--burn-step 1.2` read +20.1 % and +20.2 % against them, `--slow-step 1.2` +0.08 %).
A measurement costs some 9 minutes of CPU (the imports and the model's load under valgrind, not the shapes)."""

from __future__ import annotations

import json
import os
import queue
import shlex
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from engines.procs import spawn, stop
from harness.analysis.ab_instr import InstrReading, ShapeInstructions, callgrind_instructions
from harness.run.memory_gate_runs import RUN_FILE
from harness.run.trees import ROOT

SHAPES_FILE = ROOT / "harness" / "run" / "ab_instr_shapes.py"
TOGGLE = "_operator_call"  # CPython's operator.call, in libpython's symbol table
CONTROL_TIMEOUT_S = 120  # callgrind_control's round trip to a child that valgrind slows ~50x
# what keeps the count one number: one thread everywhere, the same hash seed, no GPU
DETERMINISM = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
               "PYTHONHASHSEED": "0", "TOKENIZERS_PARALLELISM": "false", "CUDA_VISIBLE_DEVICES": "",
               "FRAGBENCH_DEVICE": "cpu"}


class InstrProbeError(Exception):
    """The probe gave no reading: `crashed` where the tree's code raised (the build's fault), otherwise where it
    could not run (no valgrind, a flag the tree lacks, its time limit, a signal)."""

    def __init__(self, message: str, crashed: bool = False):
        super().__init__(message)
        self.crashed = crashed


def tools() -> tuple[str, str]:
    """valgrind and callgrind_control, or an InstrProbeError naming what is missing."""
    valgrind, control = shutil.which("valgrind"), shutil.which("callgrind_control")
    if valgrind is None or control is None:
        raise InstrProbeError("the instruction count needs valgrind (valgrind and callgrind_control on PATH)")
    return valgrind, control


def instructions(tree_path: Path, python: str, engine: str, engine_args: list[str], model: str,
                 limit_s: float) -> InstrReading:
    """`engine` of the tree at `tree_path` (run by `python`, with `engine_args`, its serve flags such as
    ['--burn-step', '1.2']) on `model`, each fixed shape's instructions; InstrProbeError where it gave none
    (`crashed` says whether the engine raised)."""
    valgrind, control = tools()
    deadline = time.monotonic() + limit_s
    with tempfile.TemporaryDirectory(prefix="fragbench-instr-") as tmp:
        out_file = Path(tmp) / "callgrind.out"
        cmd = [valgrind, "--tool=callgrind", "--instr-atstart=no", "--collect-atstart=no",
               f"--toggle-collect={TOGGLE}", f"--dump-after={TOGGLE}", f"--callgrind-out-file={out_file}",
               python, "-c", RUN_FILE, str(SHAPES_FILE), "--engine", engine, "--model", str(Path(model).resolve()),
               f"--engine-args={shlex.join(engine_args)}"]
        env = {**os.environ, "PYTHONPATH": str(tree_path), **DETERMINISM}
        with open(Path(tmp) / "stderr", "w+") as err:
            proc = spawn(cmd, cwd=tree_path, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err,
                         text=True)
            try:
                lines = _lines(proc)
                ready = _next(lines, proc, deadline, err, "set up")
                if "error" in ready:
                    raise InstrProbeError(f"{engine} in {tree_path} cannot be probed: {ready['error']}")
                switched = subprocess.run([control, "-i", "on", str(proc.pid)], capture_output=True, text=True,
                                          timeout=max(1.0, min(CONTROL_TIMEOUT_S, deadline - time.monotonic())))
                if switched.returncode != 0:
                    raise InstrProbeError(f"callgrind_control could not switch the instrumentation on: "
                                          f"{(switched.stderr or switched.stdout).strip()[-200:]}")
                proc.stdin.write("go\n")
                proc.stdin.flush()
                done = _next(lines, proc, deadline, err, "ran the shapes")
                proc.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise InstrProbeError(f"the instruction count of {engine} in {tree_path} ran past its limit of "
                                      f"{limit_s:g} s") from None
            finally:
                if proc.poll() is None:
                    stop(proc)
        counts = dumped_counts(out_file, len(done["shapes"]))
    shapes = tuple(ShapeInstructions(s["name"], s["decodes"], s["context"], s["prefill"], s["steps"], n)
                   for s, n in zip(done["shapes"], counts, strict=True))
    return InstrReading(engine, tuple(engine_args), shapes, done.get("torch", ""))


def dumped_counts(out_file: Path, shapes: int) -> list[int]:
    """The instructions of each shape's dump (OUT.1, OUT.2, ...: one per `operator.call`, in order)."""
    dumps = [out_file.with_name(f"{out_file.name}.{i}") for i in range(1, shapes + 1)]
    missing = [d.name for d in dumps if not d.is_file()]
    if missing:
        raise InstrProbeError(f"callgrind dumped {shapes - len(missing)} of {shapes} shapes: this Python's "
                              f"libpython may lack the symbol {TOGGLE} (stripped)")
    return [callgrind_instructions(d.read_text()) for d in dumps]


def last_words(stderr: str, returncode: int | None) -> str:
    """What a child that ended said last: its own last line (a Python error's), beside valgrind's word where valgrind
    ended it (a signal); progress bars (carriage returns) and valgrind's other lines left out."""
    lines = [t.strip() for t in stderr.replace("\r", "\n").splitlines() if t.strip()]
    own = [t for t in lines if not t.startswith("==") and not t.startswith("Loading weights")]
    ended = [t.split("== ", 1)[-1] for t in lines if "Process terminating" in t]
    words = [*own[-1:], *ended[-1:]]
    return "; ".join(words) if words else f"exit {returncode}"


def _lines(proc: subprocess.Popen) -> queue.Queue:
    """The child's stdout lines, read on a thread of their own (a deadline can then bound every wait)."""
    q: queue.Queue = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:
            q.put(line)
        q.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return q


def _next(lines: queue.Queue, proc: subprocess.Popen, deadline: float, err, stage: str) -> dict:
    """The child's next JSON line; where it ended without one, an InstrProbeError with its last words, `crashed`
    where the tree's Python code raised (exit 1 after a traceback); a child that exited 2 (a flag the tree lacks, a
    bad engine) or that a signal ended (valgrind's own failure, or the machine's) could not run."""
    while True:
        try:
            line = lines.get(timeout=max(0.1, deadline - time.monotonic()))
        except queue.Empty:
            raise subprocess.TimeoutExpired("instr probe", 0) from None
        if line is None:
            proc.wait()
            err.seek(0)
            said = err.read()
            raised = proc.returncode == 1 and "Traceback (most recent call last)" in said
            raise InstrProbeError(f"the instruction count's child ended before it {stage}: "
                                  f"{last_words(said, proc.returncode)}", crashed=raised)
        if line.startswith("{"):
            return json.loads(line)
