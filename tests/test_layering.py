"""The core stands on the standard library alone: torch, plotly, boto3 and the wire's
libraries are optional parts it never imports."""

import subprocess
import sys
import textwrap

BLOCKED = ["torch", "plotly", "boto3", "botocore", "msgpack", "cloudpickle", "safetensors",
           "numpy", "tqdm", "somatize.torch", "somatize.wire", "somatize.viz"]


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
