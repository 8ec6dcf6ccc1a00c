"""The layout is the architecture (docs/architecture.md): every module lives in a room, and a room imports
only rooms below it. This reads every import of the source tree, those inside functions too."""

from __future__ import annotations

import ast
import re

from tests.conftest import ROOT

# (room, level): a room may import its own modules and those of rooms on lower levels, nothing else.
# workloads and engines never import harness; engines never import workloads.
ROOMS = {
    "workloads": 0,
    "engines.memory": 0,  # where the KV's memory comes from: the arena, CUDA, the caching allocator, snapshots
    "engines.foundation": 0,  # sequences, sampling, shapes, processes, the registry: what every engine builds on
    "engines.kv": 1,
    "engines.interface": 2,  # Engine, its stats and OOM handling, offline generation
    "engines.scheduled": 3,
    "engines.peers": 3,
    "engines.api": 3,
    "engines.factory": 4,
    "harness.foundation": 5,  # units, GPU presets, the results files
    "harness.analysis": 6,
    "harness.plan": 6,
    "harness.monitoring": 6,  # Prometheus rules for the seeds' alerts, the check's capacity envelope
    "harness.sim": 7,
    "harness.run": 8,  # bench simulates its own run (the twin)
    "harness.views": 9,
    "harness.check": 9,
    "harness.cli": 10,
}
FOUNDATION = {
    "engines": {"engines", "engines.procs", "engines.percentile", "engines.shapes", "engines.sequence",
                "engines.token_sampling", "engines.modelbuild", "engines.registry", "engines.kv_categories",
                "engines.json_record", "engines.step_faults", "engines.host_copy"},
    "harness": {"harness", "harness.units", "harness.gpus", "harness.results", "harness.fetch"},
}
INTERFACE = {"engines.engine", "engines.oom", "engines.offline"}
LAYERS = ("workloads", "engines", "harness")  # the top level: each may import only those before it


def room(module: str) -> str:
    top = module.split(".")[0]
    if top == "workloads":
        return "workloads"
    if module in FOUNDATION.get(top, ()):
        return f"{top}.foundation"
    if module in INTERFACE:
        return "engines.interface"
    for name in ROOMS:
        if module == name or module.startswith(name + "."):
            return name
    raise AssertionError(f"{module} lives in no room: add it to ROOMS and to docs/architecture.md")


def modules() -> dict[str, ast.Module]:
    out = {}
    for top in LAYERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).with_suffix("")
            name = ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)
            out[name] = ast.parse(path.read_text())
    return out


def imports(tree: ast.Module) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # `from harness.cli import bench`
    return {m for m in out if m.split(".")[0] in LAYERS}


def test_every_import_points_down():
    found = modules()
    wrong = set()
    for name, tree in found.items():
        mine = room(name)
        for target in imports(tree):
            while target not in found and "." in target:  # `from engines.kv import PagedKV`: the module
                target = target.rsplit(".", 1)[0]
            theirs = room(target)
            if theirs != mine and ROOMS[theirs] >= ROOMS[mine]:
                wrong.add(f"{name} ({mine}) imports {target} ({theirs})")
    assert not wrong, "imports against the layout:\n" + "\n".join(sorted(wrong))


def edges(found: dict[str, ast.Module]) -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports (a package's name where the import names the package)."""
    out = {}
    for name, tree in found.items():
        targets = set()
        for target in imports(tree):
            while target not in found and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in found and target != name:
                targets.add(target)
        out[name] = targets
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative): each is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    top = stack.pop()
                    on_stack.discard(top)
                    component.append(top)
                    if top == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def test_no_import_cycle():
    """No two modules import each other, however far round (a room's own modules included, and imports inside
    functions, which the arrows between rooms cannot see)."""
    found = cycles(edges(modules()))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_cycle_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def class_definitions(found: dict[str, ast.Module]) -> dict[str, list[str]]:
    """Class name -> where each class of that name is defined (`module:line`), top-level and nested alike."""
    out: dict[str, list[str]] = {}
    for name, tree in found.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(f"{name}:{node.lineno}")
    return out


def twice(found: dict[str, ast.Module]) -> dict[str, list[str]]:
    return {cls: where for cls, where in sorted(class_definitions(found).items()) if len(where) > 1}


def test_no_class_name_is_defined_twice():
    """One name, one thing: a class name names one class across harness/, engines/ and workloads/ (a writer and a
    reader of one file are named for what they are: run/record.RunWriter, analysis/records.RunRecord)."""
    found = twice(modules())
    assert not found, "class names defined more than once:\n" + "\n".join(
        f"{cls}: {', '.join(where)}" for cls, where in found.items())


def test_the_class_rule_finds_a_name_defined_twice():
    found = {"a": ast.parse("class Trace: ...\nclass Only: ..."),
             "b": ast.parse("def f():\n    class Inner: ...\nclass Outer:\n    class Trace: ..."),
             "c": ast.parse("class Inner: ...")}
    assert twice(found) == {"Inner": ["b:2", "c:1"], "Trace": ["a:1", "b:4"]}


FEATURE_ROOMS = ("analysis", "sim", "run", "views", "cli")  # the feature table's columns after its stem


def feature_table() -> dict[str, dict[str, set[str]]]:
    """docs/architecture.md's feature table: a feature's stem -> room -> the modules its row names there."""
    page = (ROOT / "docs" / "architecture.md").read_text()
    part = page.split("## One feature across rooms: its names\n", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in part.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or cells[0] in ("feature", "---"):
            continue
        stem = re.fullmatch(r"`([a-z_]+)`", cells[1]).group(1)
        out[stem] = {room: set(re.findall(r"`([a-z_]+)\.py`", cell))
                     for room, cell in zip(FEATURE_ROOMS, cells[2:], strict=True)}
    return out


def misnamed(table: dict[str, dict[str, set[str]]], present: dict[str, set[str]]) -> list[str]:
    """What breaks the table's rule: a module a row names that is not in its room, and a module of analysis/,
    sim/, run/ or views/ whose name begins with a feature's stem and is not in that feature's row."""
    out = [f"{stem}: harness/{room}/{name}.py is not there" for stem, rooms in table.items()
           for room, names in rooms.items() for name in sorted(names - present.get(room, set()))]
    out += [f"harness/{room}/{name}.py begins with `{stem}` but is not in its row" for room in FEATURE_ROOMS[:4]
            for name in sorted(present.get(room, set())) for stem, rooms in table.items()
            if name.startswith(stem) and name not in rooms[room]]
    return out


def test_every_module_named_for_a_feature_is_in_its_row_of_the_table():
    table = feature_table()
    assert len(table) >= 10, "docs/architecture.md's feature table was not found"
    present = {room: {p.stem for p in (ROOT / "harness" / room).glob("*.py") if p.stem != "__init__"}
               for room in FEATURE_ROOMS}
    wrong = misnamed(table, present)
    assert not wrong, "docs/architecture.md's feature table and the modules disagree:\n" + "\n".join(wrong)


def test_the_naming_rule_finds_a_stray_and_a_missing_module():
    table = {"twin": {"analysis": set(), "sim": {"twin"}, "run": set(), "views": {"twin_section"}, "cli": set()}}
    present = {"sim": {"twin", "twin_fit"}, "views": set()}
    assert misnamed(table, present) == ["twin: harness/views/twin_section.py is not there",
                                        "harness/sim/twin_fit.py begins with `twin` but is not in its row"]


def test_no_two_harness_modules_outside_cli_share_a_file_name():
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "harness").rglob("*.py")):
        if path.parent.name != "cli" and path.name != "__init__.py":
            seen.setdefault(path.name, []).append(path.relative_to(ROOT).as_posix())
    twins = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not twins, f"one file name, two modules: {twins}"


def test_no_module_is_too_long():
    long = []
    for top in ("engines", "harness"):
        for path in (ROOT / top).rglob("*.py"):
            limit = 200 if path.parent.name == "cli" else 450
            lines = len(path.read_text().splitlines())
            if lines > limit:
                long.append(f"{path.relative_to(ROOT)}: {lines} lines (at most {limit})")
    assert not long, "\n".join(long)


def test_the_architecture_page_names_every_room():
    page = (ROOT / "docs" / "architecture.md").read_text()
    folders = {p.relative_to(ROOT).as_posix() for top in LAYERS for p in (ROOT / top).rglob("__init__.py")}
    missing = [f.removesuffix("/__init__.py") for f in folders if f.removesuffix("__init__.py") not in page]
    assert not missing, f"docs/architecture.md does not name {missing}"


def test_modules_that_find_the_checkout_find_it_from_their_room():
    import engines.peers.vllm
    import harness.run.bench
    import harness.run.loadargs
    import harness.run.servers

    for module in (engines.peers.vllm, harness.run.bench, harness.run.loadargs, harness.run.servers):
        assert module.ROOT == ROOT, f"{module.__name__}.ROOT is {module.ROOT}"


# A view reads a run through the typed records (harness/analysis/records.py, summary_records.py), never a dict
# from analysis/: its JSON is read once into a record where a page starts. These parameters are dicts on purpose,
# each with the reason; no other parameter of a view may be one.
VIEW_DICTS = {
    ("harness.views.check_report", "render_check", "result"): "the check room's own result (harness/check), the "
                                                              "JSON `check --json` prints, not analysis/'s",
    ("harness.views.check_report", "check_text", "result"): "the same result, as the console's text",
    ("harness.views.check_report", "verdict_line", "result"): "the same result's verdict, on the page and console",
}
DICT_READERS = {"harness.analysis.rundir": {"load_meta"}, "harness.analysis.summary": {"read_summary"}}


def bare_dict(annotation: ast.expr | None) -> bool:
    """`dict`, `dict | None`: a dict whose keys and values say nothing (`dict[str, CapacityBlock]` says)."""
    if annotation is None:
        return False
    text = ast.unparse(annotation).replace(" ", "")
    return text in ("dict", "dict|None", "None|dict", "Optional[dict]")


def test_views_take_records_not_bare_dicts_from_analysis():
    found = []
    for name, tree in modules().items():
        if not name.startswith("harness.views."):
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                args = node.args
                for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs]:
                    if bare_dict(arg.annotation) and (name, node.name, arg.arg) not in VIEW_DICTS:
                        found.append(f"{name}.{node.name}({arg.arg}: dict)")
            if isinstance(node, ast.ImportFrom) and node.module in DICT_READERS:
                found += [f"{name} imports {node.module}.{a.name} (a dict: read the record instead)"
                          for a in node.names if a.name in DICT_READERS[node.module]]
    assert not found, "views take the typed records (harness/analysis/records.py), not dicts:\n" + "\n".join(found)


def test_the_view_rule_finds_a_bare_dict():
    tree = ast.parse("def page(summary: dict, meta: dict | None = None, blocks: dict[str, int] = None): ...")
    args = tree.body[0].args.args
    assert [bare_dict(a.annotation) for a in args] == [True, True, False]


PROJECT_TOPS = set(LAYERS)


def project_import(node: ast.stmt) -> bool:
    if isinstance(node, ast.Import):
        return any(a.name.split(".")[0] in PROJECT_TOPS for a in node.names)
    return isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").split(".")[0] in PROJECT_TOPS)


def unexplained_imports(source: str) -> list[int]:
    """The lines of the project imports inside a function body with no comment saying why: none on the statement's
    own lines, none on the line directly above the run of import statements it belongs to (imports one after
    another, blank lines between them allowed, as ruff's isort sorts them into sections)."""
    lines = source.splitlines()
    out = []
    for fn in ast.walk(ast.parse(source)):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):  # every statement list below the function: if, try, with, loop bodies too
            for field in ("body", "orelse", "finalbody"):
                body = getattr(node, field, None)
                if not isinstance(body, list):
                    continue
                start = None  # the first statement of the current run of imports
                for i, stmt in enumerate(body):
                    if not isinstance(stmt, (ast.Import, ast.ImportFrom)):
                        start = None
                        continue
                    prev = body[i - 1] if i else None
                    joined = start is not None and isinstance(prev, (ast.Import, ast.ImportFrom)) and \
                        not any(line.strip() for line in lines[prev.end_lineno:stmt.lineno - 1])
                    start = start if joined else stmt
                    own = any("#" in line for line in lines[stmt.lineno - 1:stmt.end_lineno])
                    above = lines[start.lineno - 2].strip().startswith("#") if start.lineno > 1 else False
                    if project_import(stmt) and not own and not above:
                        out.append(stmt.lineno)
    return sorted(set(out))


def test_every_import_inside_a_function_says_why():
    """Imports in the module header, where they show a module's neighbours, unless a comment says why not (kept out
    of `fragbench --help`, torch kept out of a light path, an optional extra, a cycle): on the import's line or the
    line above its run of imports."""
    found = []
    for top in LAYERS:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            found += [f"{rel}:{line}" for line in unexplained_imports(path.read_text())]
    assert not found, "imports inside functions without a comment saying why:\n" + "\n".join(found)


def test_the_import_rule_finds_an_unexplained_import():
    source = '''
import json


def run(args):
    # imported when the verb runs: `fragbench --help` stays light
    from harness.sim.simulator import run_simulation
    from harness.views.sim_report import render_text

    import numpy

    from harness.plan import make_plan
    return json, run_simulation, render_text, numpy, make_plan


def show():
    """A docstring is no reason."""
    from harness.units import format_bytes
    import yaml
    if format_bytes:
        from workloads.spec import load_spec  # cycle: workloads.spec imports this module
        from workloads.traces import resolve
        return load_spec, resolve, yaml
'''
    # the one under a docstring, and the one a comment on its neighbour's line does not cover
    assert unexplained_imports(source) == [18, 22]
