"""The ``somatize`` command: read what runs left in a store, and start a worker.

    somatize runs STORE                      the runs a store holds
    somatize show STORE RUN [--forward N]    a run per node, or one forward's facts
    somatize report STORE RUN -o FILE.html   one HTML file that opens offline
    somatize health STORE RUN                what the audit's record says is unhealthy
    somatize serve STORE [--host H] [--port P] [--public]
                                             a live page over a store, in a browser;
                                             an address other than loopback needs
                                             --public, since the page has no login
    somatize export tensorboard STORE RUN DIR            a run as TensorBoard event files
    somatize export mlflow STORE RUN [--tracking-uri U]  a run as an MLflow run
    somatize worker ...                      a worker (python -m somatize.worker)
    somatize token                           a fresh random token for workers and clients
    somatize demo [--store DIR] [--steps N]  the whole job, in about 20 s

Every command that reads a store also reads one in a bucket: ``s3://BUCKET[/PREFIX]``,
with ``--endpoint URL`` (or ``AWS_ENDPOINT_URL``) and the usual AWS credential
variables. A command that needs an extra (``report`` plotly, ``serve`` the page's
libraries, ``export`` the tracker's, ``demo`` torch and plotly, an ``s3://`` store boto3)
says which one to install before it starts work.

A mistake (a store that is not there, an unknown run, a forward out of range) is one
line on stderr and exit status 2. A record a store holds that cannot be read is damage,
not a mistake: ``runs``, ``show``, ``health`` and ``report`` read the rest, say which
records they left out and why (``damaged: ...``), and exit 0; only ``show -f N`` of a
damaged forward is one line and exit 2. A traceback means a bug in somatize.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import math
import os
import secrets
import sys
import warnings
from collections.abc import Sequence
from typing import Any

from ._errors import SomaError
from ._text import table

__all__ = ["main"]

USAGE_ERROR = 2


class Refused(Exception):
    """A mistake of the caller's, said in one line."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="somatize", description="Read the runs a store holds, or start a worker.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    runs = commands.add_parser("runs", help="the runs in a store")
    _where_arguments(runs)
    show = commands.add_parser("show", help="a run per node, or the facts of one forward")
    _where_arguments(show)
    show.add_argument("run", metavar="RUN", help="the run's name (see: somatize runs STORE)")
    show.add_argument("--forward", "-f", type=int, metavar="N",
                      help="show this forward's facts (negative counts from the end)")
    report = commands.add_parser("report", help="a run as one HTML file that opens offline")
    _where_arguments(report)
    report.add_argument("run", metavar="RUN", help="the run's name")
    report.add_argument("-o", "--output", metavar="FILE", help="where to write it (default: RUN.html)")
    _serve_parser(commands)
    _export_parser(commands)
    worker = commands.add_parser("worker", help="run a worker (the same as python -m somatize.worker)",
                                 add_help=False)
    worker.add_argument("rest", nargs=argparse.REMAINDER)
    commands.add_parser("token", help="print a fresh random token (256 bits, URL-safe) for "
                                      "SOMATIZE_TOKEN or --token-file")
    for name, said in (("health", "what the audit's record of a run says is unhealthy"),
                       ("demo", "the whole job: train, record, audit, report (needs torch)")):
        commands.add_parser(name, help=said, add_help=False).add_argument(
            "rest", nargs=argparse.REMAINDER)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the command line ``argv`` (``sys.argv[1:]`` when None); answers the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:  # everything after it belongs to the worker's own parser
        return _worker(argv[1:])
    if argv[:1] == ["health"]:
        return _health(argv[1:])
    if argv[:1] == ["demo"]:
        return _demo(argv[1:])
    arguments = _parser().parse_args(argv)
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("always")
        try:
            if arguments.command == "runs":
                _print(_runs(_reading(arguments)))
            elif arguments.command == "show":
                _print(_show(_reading(arguments), arguments.run, arguments.forward))
            elif arguments.command == "report":
                _needs("the report", "viz", "plotly")
                _report(_reading(arguments), arguments.run, arguments.output)
            elif arguments.command == "serve":
                _serve(arguments)
            elif arguments.command == "export":
                _export(arguments)
            elif arguments.command == "token":
                _print([secrets.token_urlsafe(32)])
        except KeyboardInterrupt:  # Ctrl-C is how a served page is stopped
            return 0
        except (Refused, SomaError, OSError, ImportError) as exc:
            print(f"somatize {arguments.command}: {exc}", file=sys.stderr)
            return USAGE_ERROR
        finally:
            for said in dict.fromkeys(str(w.message) for w in warned if _worth_saying(w)):
                print(f"somatize {arguments.command}: warning: {said}", file=sys.stderr)
    return 0


_OWN = os.path.dirname(os.path.abspath(__file__))


def _worth_saying(warning: warnings.WarningMessage) -> bool:
    """Whether a warning heard while a command ran is the user's business: somatize's
    own, and any other library's but for its deprecations (MLflow's about SQLAlchemy's
    loaders), which are its maintainers' business and would read as ours here. Never a
    ResourceWarning, which Python itself keeps quiet unless asked: it says where the
    collector happened to run when something unclosed was let go, which may be any
    object of the process, so it tells whoever leaked it nothing and the user less."""
    if issubclass(warning.category, ResourceWarning):
        return False
    deprecation = issubclass(warning.category,
                             (DeprecationWarning, PendingDeprecationWarning, FutureWarning))
    return not deprecation or os.path.abspath(warning.filename).startswith(_OWN + os.sep)


def _print(lines: list[str]) -> None:
    try:
        sys.stdout.write("".join(line + "\n" for line in lines))
        sys.stdout.flush()
    except BrokenPipeError:  # `somatize show ... | head` stopped reading: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _needs(what: str, extra: str, *modules: str) -> None:
    """Refuses, before any work, a command whose extra is not installed, naming the
    extra. Found, not imported: the command line stays as light as the core."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise Refused(f"{what} needs {', '.join(missing)}, which "
                      f"{'is' if len(missing) == 1 else 'are'} not installed: "
                      f"pip install 'somatize[{extra}]'")


def _store(where: str) -> Any:
    """The store at a directory that already is one; reading never makes a store."""
    from .store import Store

    if not os.path.isdir(where):
        raise Refused(f"there is no store at {where}: it is not a directory")
    # The directory layout's own mark (see somatize.store.local): without it, opening
    # would turn an arbitrary directory into an empty store.
    if not os.path.isdir(os.path.join(where, "names")):
        raise Refused(f"{where} is a directory but not a store (it has no names/ in it)")
    return Store(where, durable=False)


# -- runs ---------------------------------------------------------------------------------
def _when(seconds: float) -> str:
    try:
        moment = datetime.datetime.fromtimestamp(seconds, datetime.UTC)
    except (OverflowError, ValueError, OSError):  # a record may say any number
        return f"{seconds} s"
    return moment.strftime("%Y-%m-%d %H:%M:%S")


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}" if math.isfinite(value) else str(value)
    if isinstance(value, (dict, list)):
        return "…"
    return str(value)


def _runs(store: Any) -> list[str]:
    from .record import runs

    found = runs(store)
    if not found:
        return [f"no runs in {store.where} (a Recorder(store) writes one)"]
    summaries = []
    for run in found:  # a loss is shown whether or not the Recorder summarised it
        summary = dict(run.summary)
        if "loss" not in summary:
            loss = _last_loss(store, run.name)
            if loss is not None:
                summary["loss"] = loss
        summaries.append(summary)
    keys = list(dict.fromkeys(key for summary in summaries for key in summary))
    header = ["run", "forwards", "first (UTC)", "last (UTC)"] + [f"last {key}" for key in keys]
    rows = [[run.name, str(run.forwards), _when(run.first), _when(run.last)]
            + [_value(summary[key]) if key in summary else "" for key in keys]
            for run, summary in zip(found, summaries)]
    return table(header, rows, right={1} | set(range(4, 4 + len(keys))))


LOOKED_BACK = 4  # batches read, newest first, for the loss of a run that summarised nothing


def _last_loss(store: Any, run: str) -> Any:
    """The value of the last ``loss`` fact of a run whose Recorder summarised nothing, read
    from its last few batches (a batch holds up to a thousand forwards); None if none."""
    from .record._read import forwards_of, read

    prefix = f"run/{run}/"
    batches = sorted(((int(b.name[len(prefix):]), b) for b in store.bound(prefix[:-1])
                      if b.name[len(prefix):].isdigit() and b.name[len(prefix):].isascii()),
                     key=lambda pair: pair[0])
    for index, batch in reversed(batches[-LOOKED_BACK:]):
        for _, forward in reversed(forwards_of(batch, index)):
            try:
                said = read(store, forward).get("facts", [])
            except SomaError:  # a record that cannot be read costs its loss, not the listing
                return None
            for fact in reversed(said):
                if type(fact) is dict and fact.get("fact") == "loss" and "value" in fact:
                    return fact["value"]
    return None


# -- show ---------------------------------------------------------------------------------
_KNOWN = ("fact", "node", "host", "began_us", "took_us")


def _facts_table(facts: list[dict[str, Any]]) -> list[str]:
    rows = []
    for at, fact in enumerate(facts):
        if type(fact) is not dict:
            rows.append([str(at), "?", "", "", "", "", repr(fact)])
            continue
        rest = []
        for key, value in fact.items():
            if key in _KNOWN:
                continue
            if key == "at_us" and isinstance(value, int):  # the wall clock a forward began at
                rest.append(f"at {_when(value // 1_000_000)}.{value % 1_000_000:06d} UTC")
                continue
            rest.append(f"{key}={_value(value) if not isinstance(value, str) else value}")
        rows.append([str(at), str(fact.get("fact", "?")), str(fact.get("node", "")),
                     str(fact.get("host", "")), _us(fact.get("began_us")), _us(fact.get("took_us")),
                     " ".join(rest)])
    return table(["#", "fact", "node", "host", "began µs", "took µs", "more"], rows, right={0, 4, 5})


def _us(value: Any) -> str:
    return "" if value is None else str(value)


def _nodes_table(store: Any, run: str) -> list[str]:
    from .record._read import tally

    summed = tally(store, run)
    head = [f"run {run}: {summed.forwards} forwards, {summed.took_us / 1000:.6g} ms end to end"
            + (f", {summed.failed} failed" if summed.failed else "")
            + (f", {len(summed.damaged)} damaged (left out)" if summed.damaged else ""),
            "(end to end: the forwards alone; a node's total ms below adds the backward passes "
            "recorded for it, so it may be more)"]
    # A record that cannot be read is said, and the rest shown: one bad record of many
    # hands must not hide a run.
    damage = [f"damaged: {why}" for why in summed.damaged.values()]
    if not summed.nodes:
        return head + ["no node ran"] + damage
    total = sum(entry["total_us"] for entry in summed.nodes.values()) or 1
    rows = [[node, e["host"] or "here", str(e["ran"]), str(e["recalled"]), str(e["kept"]),
             str(e["unneeded"]), str(e["failed"]), f"{e['total_us'] / 1000:.6g}",
             f"{e['mean_us'] / 1000:.4g}", f"{100 * e['total_us'] / total:.1f}%"]
            for node, e in sorted(summed.nodes.items(), key=lambda item: -item[1]["total_us"])]
    lines = head + [""] + table(
        ["node", "where", "ran", "recalled", "kept", "unneeded", "failed", "total ms", "mean ms", "share"],
        rows, right=set(range(2, 10)))
    for host, hop in summed.hops.items():
        lines.append(f"wire to {host}: sent {hop['sent']}× ({hop['sent_bytes']} bytes, "
                     f"{hop['sent_us'] / 1000:.6g} ms), received {hop['received']}× "
                     f"({hop['received_bytes']} bytes, {hop['received_us'] / 1000:.6g} ms)")
    if summed.evaluated:
        lines += ["", *_evaluations(summed.evaluated)]
    return lines + damage


def _evaluations(said: list[dict[str, Any]]) -> list[str]:
    """A table of a run's evaluations (``Trainer.evaluate``): one row each, by step."""
    names = list(dict.fromkeys(k for one in said for k in one if k not in ("step", "rows")))
    rows = [[str(one.get("step", "")), str(one.get("rows", ""))]
            + [f"{one[n]:.6g}" if isinstance(one.get(n), (int, float)) else "" for n in names]
            for one in said]
    return ["evaluated:", *table(["after step", "rows", *names], rows,
                                 right=set(range(2 + len(names))))]


def _show(store: Any, run: str, forward: int | None) -> list[str]:
    from .record import facts

    if forward is None:
        return _nodes_table(store, run)
    said = facts(store, run, forward)
    return [f"run {run}, forward {forward}: {len(said)} facts", ""] + _facts_table(said)


# -- report -------------------------------------------------------------------------------
def _report(store: Any, run: str, output: str | None) -> None:
    from .health import report

    target = output or f"{run}.html"
    folder = os.path.dirname(os.path.abspath(target))
    if not os.path.isdir(folder):
        raise Refused(f"cannot write {target}: {folder} is not a directory")
    written = report(store, run, target)
    print(f"wrote {written} ({os.path.getsize(written) // 1024} KiB; opens offline)")


# -- serve and export ---------------------------------------------------------------------
def _where_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("store", metavar="STORE",
                        help="the store's directory, or s3://BUCKET[/PREFIX] for a bucket")
    parser.add_argument("--endpoint", metavar="URL",
                        help="the S3 endpoint of an s3:// store (default: $AWS_ENDPOINT_URL, "
                             "else AWS in --region)")
    parser.add_argument("--region", default=None, metavar="REGION",
                        help="the bucket's region (default: $AWS_REGION, else us-east-1)")


def _serve_parser(commands: Any) -> None:
    serve = commands.add_parser("serve", help="a live, read-only page over a store, in a browser")
    _where_arguments(serve)
    serve.add_argument("--host", default="127.0.0.1",
                       help="the address to listen on (default 127.0.0.1: this machine only)")
    serve.add_argument("--port", type=int, default=8765, help="the port (default 8765; 0: any free one)")
    serve.add_argument("--public", action="store_true",
                       help="allow an address other than loopback (the page has no login)")


def _export_parser(commands: Any) -> None:
    export = commands.add_parser("export", help="a run into TensorBoard or MLflow")
    trackers = export.add_subparsers(dest="tracker", metavar="TRACKER", required=True)
    tensorboard = trackers.add_parser("tensorboard", help="event files for tensorboard --logdir DIR")
    _where_arguments(tensorboard)
    tensorboard.add_argument("run", metavar="RUN", help="the run's name (see: somatize runs STORE)")
    tensorboard.add_argument("directory", metavar="DIR", help="the log directory (the run goes in DIR/RUN)")
    mlflow = trackers.add_parser("mlflow", help="a new MLflow run")
    _where_arguments(mlflow)
    mlflow.add_argument("run", metavar="RUN", help="the run's name (see: somatize runs STORE)")
    mlflow.add_argument("--tracking-uri", metavar="URI",
                        help="MLflow's tracking URI (default: $MLFLOW_TRACKING_URI, else MLflow's own)")
    mlflow.add_argument("--experiment", default="somatize", help="the MLflow experiment (default somatize)")


def _reading(arguments: argparse.Namespace) -> Any:
    """The store named on the command line, opened to be read: a directory that is a
    store, or a bucket, opened without the write that checks conditional writes."""
    where = arguments.store
    if not where.startswith("s3://"):
        if arguments.endpoint:
            raise Refused(f"--endpoint is for an s3:// store, and {where} is a directory")
        return _store(where)
    bucket, _, prefix = where.removeprefix("s3://").partition("/")
    if not bucket:
        raise Refused(f"{where} names no bucket: write s3://BUCKET or s3://BUCKET/PREFIX")
    _needs(f"a store in a bucket ({where})", "s3", "boto3")
    from .store import Store
    from .store.bucket import BucketBackend

    region = arguments.region or os.environ.get("AWS_REGION") or "us-east-1"
    endpoint = arguments.endpoint or os.environ.get("AWS_ENDPOINT_URL")
    hosted = endpoint is None  # AWS itself prefers the bucket in the host name
    endpoint = endpoint or f"https://s3.{region}.amazonaws.com"
    return Store.over(BucketBackend(endpoint, bucket, region=region, hosted=hosted,
                                    prefix=prefix.strip("/")))


def _serve(arguments: argparse.Namespace) -> None:
    _needs("the page", "web", "starlette", "uvicorn")
    try:
        from .web import serve
    except ImportError as exc:
        raise Refused(str(exc)) from None
    serve(_reading(arguments), host=arguments.host, port=arguments.port, public=arguments.public)


def _export(arguments: argparse.Namespace) -> None:
    _needs(f"the {arguments.tracker} export", "trackers",
           "tensorboard" if arguments.tracker == "tensorboard" else "mlflow")
    store = _reading(arguments)
    if arguments.tracker == "tensorboard":
        from .health import diagnose
        from .record import export_tensorboard

        folder = export_tensorboard(store, arguments.run, arguments.directory,
                                    findings=diagnose(store, arguments.run))
        print(f"wrote run {arguments.run} to {folder}; see it with: tensorboard --logdir "
              f"{arguments.directory}")
    else:
        from .health import diagnose
        from .record import export_mlflow

        try:
            logged = export_mlflow(store, arguments.run, tracking_uri=arguments.tracking_uri,
                                   experiment=arguments.experiment,
                                   findings=diagnose(store, arguments.run))
        except Exception as exc:  # MLflow's own errors are one line here, like ours
            if not type(exc).__module__.startswith("mlflow"):
                raise
            raise Refused(f"MLflow refused it: {exc}") from None
        print(f"logged run {arguments.run} as MLflow run {logged} in experiment "
              f"{arguments.experiment!r}")


# -- health -------------------------------------------------------------------------------
def _health_parser() -> argparse.ArgumentParser:
    from .health import DEFAULTS

    parser = argparse.ArgumentParser(
        prog="somatize health",
        description="What the health rules find in a run's record (nothing is trained).")
    _where_arguments(parser)
    parser.add_argument("run", metavar="RUN", help="the run's name (see: somatize runs STORE)")
    parser.add_argument("--threshold", "-t", action="append", default=[], metavar="NAME=VALUE",
                        help=f"change one threshold; the names are {', '.join(DEFAULTS)}")
    return parser


def _health(argv: list[str]) -> int:
    """``somatize health STORE RUN [--threshold NAME=VALUE ...]``: 0 with the findings
    printed (or "no findings"), 2 with one line on stderr for a store, run or threshold
    that cannot be used."""
    from .health import findings_told, judged_facts, thresholds_from

    try:
        arguments = _health_parser().parse_args(argv)
    except SystemExit as exc:  # argparse has said what was wrong (or printed --help)
        return exc.code if isinstance(exc.code, int) else USAGE_ERROR
    from .record._read import damaged

    try:
        thresholds = thresholds_from(_pairs(arguments.threshold))
        store = _reading(arguments)
        facts = judged_facts(store, arguments.run)
        left_out = damaged(store, arguments.run)
    except (Refused, SomaError, OSError, ValueError, TypeError) as exc:
        print(f"somatize health: {exc}", file=sys.stderr)
        return USAGE_ERROR
    # Judged from the records that could be read; the others are said, not hidden.
    _print(findings_told(arguments.run, facts, thresholds)
           + [f"damaged (left out): {why}" for why in left_out.values()])
    return 0


def _pairs(pairs: list[str]) -> dict[str, float]:
    out = {}
    for pair in pairs:
        name, equals, value = pair.partition("=")
        try:
            number = float(value) if equals else None
        except ValueError:
            number = None
        if number is None:
            raise Refused(f"--threshold takes NAME=VALUE with a number, such as dying=0.8, "
                          f"not {pair!r}")
        out[name.strip()] = number
    return out


# -- demo ---------------------------------------------------------------------------------
def _demo(argv: list[str]) -> int:
    try:  # it trains with torch, talks to its worker over the wire and draws its report
        _needs("the demo", "torch,viz", "torch", "msgpack", "cloudpickle", "plotly")
        from .torch import _demo as demo
    except Refused as exc:
        print(f"somatize demo: {exc}", file=sys.stderr)
        return USAGE_ERROR
    except ImportError as exc:
        print(f"somatize demo: it needs {exc.name}, which is not installed: "
              "pip install 'somatize[torch,viz]'", file=sys.stderr)
        return USAGE_ERROR
    return demo.main(argv)


# -- worker -------------------------------------------------------------------------------
def _worker(argv: list[str]) -> int:
    try:
        from . import worker
    except ModuleNotFoundError as exc:
        if exc.name in ("somatize.worker", f"{__package__}.worker"):
            print("somatize worker: this installation of somatize has no worker yet",
                  file=sys.stderr)
        else:
            print(f"somatize worker: the worker needs {exc.name}, which is not installed: "
                  "pip install 'somatize[wire]'", file=sys.stderr)
        return USAGE_ERROR
    answer = worker.main(argv)
    return answer if isinstance(answer, int) else 0
