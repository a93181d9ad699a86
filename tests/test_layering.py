"""The layering rule: every part of the code imports only parts below it, so each layer can be read, tested and
replaced without the ones above. The order is stated once, here, and quoted in docs/architecture.md.

Imports are read from the source (module level, inside functions, under TYPE_CHECKING alike): a type-only
import is a dependency too."""
from __future__ import annotations

import ast
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# bottom to top; a unit is a package (a folder) or a module of smartspec/ or deployments/
LAYERS = [
    "smartspec.lazy",         # the lazy-attribute helper for package __init__ files
    "smartspec.types",        # plain data: requests, sampling params, step records, trees, the policy's view
    "smartspec.runtime",      # executes forwards: KV blocks, model runner and backends, attention, sampling
    "smartspec.structured",   # grammars for structured outputs (llguidance): masks, draft cuts, forced tokens
    "smartspec.models",       # finds and loads models (GGUF parts from PyPI, HF directories)
    "smartspec.policy",       # how many tokens each request speculates: numbers in, a plan out
    "smartspec.spec_decode",  # proposers, lossless acceptance, the proposer factory, SpeculativeConfig
    "smartspec.config",       # EngineConfig
    "smartspec.engine",       # scheduler and the step loop; the asyncio engine the replica drives
    "smartspec.bench",        # load generator, workloads, reports
    "smartspec.llm",          # the offline API
    "smartspec.sim",          # the discrete-event simulator on the engine's own planning and commit
    "smartspec.cli",          # the `smartspec` command
    "smartspec",              # the package root: lazily exposes LLM, SamplingParams, EngineConfig
    "deployments",            # the Ray Serve application's package (its docstring alone)
    "deployments.wire",       # the typed call and events between the HTTP front and the replicas
    "deployments.control",    # the application's config, the goodput controller, metrics
    "deployments.placement",  # the router's estimate and class, failover, autoscaling
    "deployments.replica",    # LLMServer, the draft actor, tensor-parallel workers
    "deployments.http",       # the OpenAI front: protocol, the answers' fold, tool calls, the ingress
    "deployments.app",        # the application builder `serve run` calls
]


def unit_of(module: str) -> str | None:
    """The layer unit a dotted module name belongs to (the longest listed prefix), or None if it is not ours."""
    best = None
    for unit in LAYERS:
        if module == unit or module.startswith(unit + "."):
            if best is None or len(unit) > len(best):
                best = unit
    return best


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every import in a file, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out.append((node.lineno, base))
            # `from smartspec import runtime` imports the submodule smartspec.runtime
            out.extend((node.lineno, f"{base}.{alias.name}") for alias in node.names
                       if unit_of(f"{base}.{alias.name}") not in (None, unit_of(base)))
    return out


def layering_violations(root: Path) -> list[str]:
    """Every import of a unit at or above the importing unit's own layer (other than itself), as readable lines."""
    rank = {unit: i for i, unit in enumerate(LAYERS)}
    problems = []
    for top in ("smartspec", "deployments"):
        for path in sorted((root / top).rglob("*.py")):
            module = module_name(path, root)
            own = unit_of(module)
            for line, name in imported_modules(path, module):
                target = unit_of(name)
                if target is None or target == own:
                    continue
                if rank[target] > rank[own]:
                    problems.append(f"{path.relative_to(root)}:{line}: {own} (layer {rank[own]}) imports {name} "
                                    f"(layer {rank[target]}, above it)")
    return problems


def test_every_unit_is_listed():
    """A new package or top-level module must take its place in the order."""
    units = set()
    for top in ("smartspec", "deployments"):
        units |= {module_name(p, ROOT) for p in (ROOT / top).glob("*.py")}
        units |= {f"{top}.{p.parent.name}" for p in (ROOT / top).glob("*/__init__.py")}
    missing = sorted(u for u in units if u not in LAYERS)
    assert not missing, f"add these to LAYERS in tests/test_layering.py (and docs/architecture.md): {missing}"


def test_imports_go_downward_only():
    problems = layering_violations(ROOT)
    assert not problems, "upward imports:\n" + "\n".join(problems)


def test_the_policy_sees_numbers_only():
    """The policy package imports no engine, runtime, spec_decode or model code (and so no torch through them)."""
    for path in (ROOT / "smartspec" / "policy").rglob("*.py"):
        module = module_name(path, ROOT)
        for line, name in imported_modules(path, module):
            assert unit_of(name) in (None, "smartspec.lazy", "smartspec.types", "smartspec.policy"), \
                f"{path.relative_to(ROOT)}:{line} imports {name}"


@pytest.mark.parametrize("where, statement", [
    ("smartspec/runtime/sampler.py", "from smartspec.engine.scheduler import Scheduler"),
    ("smartspec/policy/base.py", "    from smartspec.spec_decode.proposer import Proposal"),  # inside a function
    ("smartspec/types/request.py", "from ..runtime import block_manager"),  # relative
    ("deployments/placement/failover.py", "from deployments.http.answers import sse"),
    ("deployments/wire.py", "from deployments.replica import server"),
])
def test_an_upward_import_is_caught(tmp_path, where, statement):
    """The check itself: a copy of the tree with one upward import added fails it, naming the line."""
    for top in ("smartspec", "deployments"):
        shutil.copytree(ROOT / top, tmp_path / top, ignore=shutil.ignore_patterns("__pycache__", "*.cpp", "*.h"))
    assert layering_violations(tmp_path) == []
    path = tmp_path / where
    text = path.read_text()
    if statement.startswith(" "):
        text += f"\n\ndef _added():\n{statement}\n"
    else:
        text += f"\n{statement}\n"
    path.write_text(text)
    problems = layering_violations(tmp_path)
    assert len(problems) == 1 and problems[0].startswith(where), problems


# what LLMEngine.snapshot, load_costs and a RequestOutput's metrics were as dicts: their keys
ENGINE_KEYS = {"spec_decode", "steps", "prefix_cache", "running", "waiting", "free_blocks", "total_blocks",
               "policy_state", "request_speed", "prefill_s_per_token", "draft_available", "draft_failures",
               "arrival_time", "first_token_time", "finish_time", "chosen_k", "num_draft_tokens"}


def dict_reads_of_the_engine(path: Path) -> list[str]:
    """Reads of the engine's reports by key in a file: a subscript (or .get) of something named snapshot or
    metrics, or by one of ENGINE_KEYS. The engine hands the replica and the offline API typed objects
    (types/snapshot.py, types/metrics.py); a key read would mean a dict crossed again."""
    problems = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            target, key = node.value, node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args:
            target, key = node.func.value, node.args[0]
        else:
            continue
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", None)
        if name in ("snapshot", "metrics") or (isinstance(key, ast.Constant) and key.value in ENGINE_KEYS):
            problems.append(f"{path.relative_to(path.parents[2])}:{node.lineno}: {ast.unparse(node)}")
    return problems


def engine_readers(root: Path) -> list[Path]:
    return sorted((root / "deployments" / "replica").glob("*.py")) + [root / "smartspec" / "llm.py"]


def test_no_dict_crosses_from_the_engine_to_the_replica_or_the_offline_api():
    problems = [p for path in engine_readers(ROOT) for p in dict_reads_of_the_engine(path)]
    assert not problems, "reads of the engine's reports by key:\n" + "\n".join(problems)


@pytest.mark.parametrize("line", ['spec = out.metrics["spec_decode"]', 'x = snapshot.get("running")',
                                  'speed = costs["request_speed"]'])
def test_a_dict_read_of_the_engine_is_caught(tmp_path, line):
    """The check itself: the replica's server with one such read added fails it."""
    path = tmp_path / "deployments" / "replica" / "server.py"
    path.parent.mkdir(parents=True)
    added = f"\n\ndef added(out, snapshot, costs):\n    {line}\n"
    path.write_text((ROOT / "deployments" / "replica" / "server.py").read_text() + added)
    added_at = len(path.read_text().splitlines())
    assert [p.split(": ")[0] for p in dict_reads_of_the_engine(path)] == [f"deployments/replica/server.py:{added_at}"]


def test_the_async_engine_is_an_engine_client():
    """LLMServer depends on EngineClient; AsyncEngine, which it runs, has each of its members, coroutines where the
    protocol's are."""
    import inspect

    from smartspec.engine.async_engine import AsyncEngine
    from smartspec.engine.client import EngineClient

    members = {n for n in vars(EngineClient) if not n.startswith("_")} | set(EngineClient.__annotations__)
    assert {"submit", "abort", "snapshot", "load_costs", "import_policy_state", "tokenizer"} <= members
    for name in members:
        assert hasattr(AsyncEngine, name) or name in ("errored",), name
        ours = vars(EngineClient).get(name)
        if inspect.isfunction(ours):
            assert inspect.iscoroutinefunction(ours) == inspect.iscoroutinefunction(getattr(AsyncEngine, name)), name
    server = ROOT / "deployments" / "replica" / "server.py"
    imported = {name for _, name in imported_modules(server, "deployments.replica.server")}
    assert "smartspec.engine.client" in imported
    assert not imported & {"smartspec.engine.async_engine", "smartspec.engine.llm_engine"}
