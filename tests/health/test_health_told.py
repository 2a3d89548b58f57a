"""``somatize health STORE RUN``: the findings as a table, or one line and status 2."""

from healthruns import chain, recorded

from somatize.cli import main
from somatize.store import Store


def command(argv):
    """``somatize health ...``, as the command line runs it (findings_told prints)."""
    return main(["health", *argv])


def dead(n):
    return {"act_zero": 1.0 if n > 2 else 0.3, "grad_norm": 1.0, "update_ratio": 1e-3,
            "nonfinite": 0}


def fine(n):
    return {"act_zero": 0.5, "grad_norm": 1.0, "update_ratio": 1e-3, "nonfinite": 0}


def test_the_findings_are_a_table_of_where_what_since_and_evidence(tmp_path, capsys):
    store = Store(str(tmp_path))
    recorded(store, "sick", chain(20, **{"body.net.1": dead, "body": fine, "head": fine}))
    assert command([str(tmp_path), "sick"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "run sick: 20 measured steps of 3 places (a node, or a layer in one), 20 losses"
    assert out[2].split() == ["where", "what", "since", "evidence"]
    assert out[4].split()[:3] == ["body.net.1", "dying", "3"]
    assert "act_zero >= 0.9 for 18 steps" in out[4]
    assert out[5].startswith("    advice: Most of what body.net.1 produces is exactly 0")


def test_no_findings_is_said_and_a_threshold_can_be_moved(tmp_path, capsys):
    store = Store(str(tmp_path))
    recorded(store, "well", chain(20, body=fine, head=fine))
    assert command([str(tmp_path), "well"]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "no findings"
    assert command([str(tmp_path), "well", "--threshold", "dying=0.4", "-t", "window=5"]) == 0
    out = capsys.readouterr().out
    assert "thresholds changed: dying=0.4, window=5" in out
    rows = out.splitlines()[4:]
    assert [line.split()[:3] for line in rows[::2]] == [["body", "dying", "1"],
                                                        ["head", "dying", "1"]]
    assert all(line.startswith("    advice: ") for line in rows[1::2])


def test_a_run_that_was_not_audited_says_how_to_audit_it(tmp_path, capsys):
    store = Store(str(tmp_path))
    recorded(store, "plain", [{}, {}])
    assert command([str(tmp_path), "plain"]) == 0
    assert "not audited" in capsys.readouterr().out


def test_a_run_with_only_its_loss_is_judged_by_the_loss_and_says_so(tmp_path, capsys):
    store = Store(str(tmp_path))
    recorded(store, "flat", [{}] * 40, loss=lambda n: 1.386 + 0.01 * (n % 3))
    assert command([str(tmp_path), "flat"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "40 losses and no health facts, so only the loss is judged" in out[0]
    assert out[4].split()[:3] == ["loss", "plateau", "1"]
    assert out[5].startswith("    advice: The loss sits at 1.4 = ln 4")


def test_what_cannot_be_used_is_one_line_on_stderr_and_status_2(tmp_path, capsys):
    store = Store(str(tmp_path))
    recorded(store, "well", chain(3, body=fine))
    for argv, says in [([str(tmp_path / "nowhere"), "well"], "no store at"),
                       ([str(tmp_path), "nope"], "no run 'nope'; its runs are 'well'"),
                       ([str(tmp_path), "well", "-t", "dying"], "NAME=VALUE"),
                       ([str(tmp_path), "well", "-t", "dead=0.5"], "no threshold 'dead'"),
                       ([str(tmp_path), "well", "-t", "window=0"], "window=0")]:
        assert command(argv) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("somatize health: ") and says in err[0], err
    assert command([]) == 2  # argparse says the usage
    assert "usage: somatize health" in capsys.readouterr().err
