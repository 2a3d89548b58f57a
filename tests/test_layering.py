"""The core stands on the standard library alone: torch, plotly, boto3, the wire's
libraries, the web page's and the trackers' are optional parts it never imports."""

import subprocess
import sys
import textwrap

BLOCKED = ["torch", "plotly", "boto3", "botocore", "msgpack", "cloudpickle", "safetensors",
           "numpy", "tqdm", "starlette", "uvicorn", "tensorboard", "mlflow", "somatize.torch",
           "somatize.wire", "somatize.viz", "somatize.web"]


def run_blocked(code: str) -> subprocess.CompletedProcess:
    prelude = textwrap.dedent(f"""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split('.')[0] in {BLOCKED!r} or name in {BLOCKED!r}:
                    raise ImportError('blocked for this test: ' + name)
        sys.meta_path.insert(0, Block())
    """)
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)],
                          capture_output=True, text=True, timeout=60)


def test_the_core_runs_with_optional_parts_missing():
    done = run_blocked("""
        import somatize
        from somatize import Graph, Node, Opaque
        class A(Node):
            def forward(self, x, ctx):
                return Opaque(x + 1)
        g = Graph.somatize(A() >> A())
        assert g.forward(1) == 3
        g.plan_json(); g.foreseen_json(1)
        loaded = sorted(m for m in sys.modules if m.split('.')[0] in
                        ('torch', 'plotly', 'boto3', 'msgpack', 'cloudpickle', 'numpy'))
        assert not loaded, loaded
        print('ok')
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_importing_somatize_loads_only_the_core():
    done = run_blocked("""
        import somatize
        heavy = [m for m in sys.modules if m.startswith('somatize.')
                 and m.split('.')[1] in ('torch', 'wire', 'viz', 'record', 'health')]
        assert not heavy, heavy
        print('ok')
    """)
    assert done.returncode == 0, done.stderr


def test_the_record_and_health_read_without_the_web_or_the_trackers():
    done = run_blocked("""
        import somatize.record, somatize.health
        from somatize.record import export_tensorboard, to_mlflow
        loaded = sorted(m for m in sys.modules if m.split('.')[0] in
                        ('starlette', 'uvicorn', 'tensorboard', 'mlflow')
                        or m.startswith('somatize.web'))
        assert not loaded, loaded
        print('ok')
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_only_the_command_line_reaches_up_to_the_web_page():
    """The page is a face: it reads record, health, viz and the store; none of them, nor
    anything else below, imports it (the command line starts it)."""
    import ast
    from pathlib import Path

    import somatize

    root = Path(somatize.__file__).parent
    reaching = []
    for path in root.rglob("*.py"):
        if path.relative_to(root).parts[0] in ("web", "cli.py"):
            continue
        package = ".".join(("somatize",) + path.relative_to(root).parent.parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                module = f"{base}.{node.module or ''}" if node.level else node.module or ""
                names = [module] + [f"{module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            if any(name == "somatize.web" or name.startswith("somatize.web.") for name in names):
                reaching.append(str(path.relative_to(root)))
    assert not reaching, reaching
