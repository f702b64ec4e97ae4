"""`msdata-server`: serve | demo | status | health | validate | cleanup (ARCHITECTURE §4.1)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

import orjson

from msdata_client._paths import ENDPOINT_ENV, default_endpoint
from msdata_client.tokenizer import pad_warning

from .config import LOG_FORMATS, LOG_LEVELS, ROLES, load_config
from .errors import ConfigError, MsdataError
from .ops.logs import configure_logging

if TYPE_CHECKING:
    from msdata_client.spec import JobSpec, SourceSpec

    from .sources.base import Source

__all__ = ["main"]

log = logging.getLogger("msdata_server")


def _endpoint(args) -> str:
    """The server's socket: --endpoint, else the [node] socket of --config, else $MSDATA_ENDPOINT, else the
    default (as for clients)."""
    if args.endpoint:
        return args.endpoint
    if args.config:
        return load_config(args.config).node.socket
    return os.environ.get(ENDPOINT_ENV) or default_endpoint()


def _at_least_one(v: str) -> int:
    try:
        n = int(v)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{v!r} must be an integer >= 1")
    return n


def _positive(v: str) -> float:
    try:
        x = float(v)
    except ValueError:
        x = 0.0
    if not 0 < x < 1e6:
        raise argparse.ArgumentTypeError(f"{v!r} must be a number of seconds > 0")
    return x


def _lean_memory() -> None:
    """Arrow's jemalloc pool returns freed decode buffers to the OS (the default kept 75-100 MiB of them);
    it must be chosen before pyarrow is first imported (an explicit setting wins). glibc's heap keeps to
    small objects (reclaim.tune_allocator)."""
    os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", "jemalloc")
    from .reclaim import tune_allocator

    tune_allocator()  # glibc: buffers of megabytes mapped on their own, not fragmenting the heap


def _cmd_serve(args) -> int:
    _lean_memory()
    import uvloop

    from .node import NodeServer

    cfg = load_config(args.config)
    configure_logging(args.log_level or cfg.node.log_level, args.log_format or cfg.node.log_format)

    async def run() -> int:
        server = NodeServer(cfg)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.request_stop)
        try:
            await server.start()
            # the readiness signal: one JSON line on stdout (tests and supervisors wait for it)
            print(
                orjson.dumps(
                    {
                        "event": "ready",
                        "socket": cfg.node.socket,
                        "pid": os.getpid(),
                        "node": cfg.node.id,
                        "role": server.role,
                        "listen": server.cluster.listen if server.cluster is not None else None,
                        "metrics": server.metrics_port,
                    }
                ).decode(),
                flush=True,
            )
            await server.serve_forever()
            log.info("stop requested; draining")
        finally:
            await server.aclose()
        return 1 if server.failure is not None else 0

    return uvloop.run(run())


def _cmd_status(args) -> int:
    from msdata_client.wire import request

    endpoint = _endpoint(args)
    if args.watch:
        if args.json:
            print("msdata-server status: --watch draws a screen; it does not combine with --json", file=sys.stderr)
            return 2
        from .ops.watch import watch

        # Ctrl-C (SIGINT) leaves the screen even when started with SIGINT ignored (a background job of a
        # non-interactive shell inherits that, and Python then never raises KeyboardInterrupt)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            return watch(endpoint, args.interval)
        except KeyboardInterrupt:  # the usual way to leave the screen
            print(file=sys.stderr)
            return 0
    try:
        f = request(endpoint, {"t": "status"})
    except OSError as e:
        print(
            f"msdata-server status: no server at {endpoint!r} ({e}); is `msdata-server serve` running?", file=sys.stderr
        )
        return 2
    st = f.get("status", {})
    if args.json:
        print(orjson.dumps(st).decode())
        return 0
    print(_format_status(st))
    return 0


def _cmd_lineage(args) -> int:
    from .lineage.command import run

    args.endpoint_path = _endpoint(args)
    return run(args)


def _cmd_health(args) -> int:
    """Liveness/readiness for probes: 0 when the server answers a status request with a known role, else 1
    with one line on stderr saying why."""
    from msdata_client.wire import request

    endpoint = _endpoint(args)
    try:
        reply = request(endpoint, {"t": "status"}, timeout=args.timeout)
    except (OSError, MsdataError) as e:
        print(
            f"msdata-server health: unhealthy: no status from {endpoint!r} within {args.timeout:g}s ({e})",
            file=sys.stderr,
        )
        return 1
    st = reply.get("status")
    if not isinstance(st, dict):
        print(
            f"msdata-server health: unhealthy: {endpoint!r} answered {reply.get('t')!r} instead of a status "
            f"({reply.get('message', '')})",
            file=sys.stderr,
        )
        return 1
    role = st.get("role")
    if role not in ROLES:
        print(
            f"msdata-server health: unhealthy: node {st.get('node')} has no role yet ({role!r}; expected one of "
            f"{', '.join(ROLES)})",
            file=sys.stderr,
        )
        return 1
    sd = st.get("state_dir") or {}
    if sd.get("error"):  # a job here waits (or would) for its planner state to be saved: not healthy
        print(f"msdata-server health: degraded: node {st.get('node')}: {sd['error']}", file=sys.stderr)
        return 1
    print(f"ok: node {st.get('node')} role {role} jobs {len(st.get('jobs') or [])}")
    return 0


def _format_status(st: dict) -> str:
    """The one-shot status for people: the table ``--watch`` draws (ops.watch.render), once, as wide as the
    terminal (80 columns when piped)."""
    import shutil

    from .ops.watch import render

    width = shutil.get_terminal_size((80, 24)).columns if sys.stdout.isatty() else 80
    head, _, rest = render(st, max(width, 20)).partition("\n")
    ident = f"{st.get('node')}  {st.get('role')}  pid {st.get('pid')}"
    if head.startswith(ident):  # one-shot output names its fields (the watch screen saves the width)
        head = f"node {st.get('node')}  role {st.get('role')}  pid {st.get('pid')}" + head[len(ident) :]
    lines = [head, f"socket {st.get('socket')}", rest.rstrip("\n")]
    for j in st.get("jobs", []):
        if j.get("waiting_for"):
            lines.append(f"job {j['name']} waiting for: {j['waiting_for']}")
    if (st.get("state_dir") or {}).get("error"):
        lines.append(f"state_dir: {st['state_dir']['error']}")
    return "\n".join(lines)


_PROBE_RECORDS = 8  # records of each source validate --job transforms


def _cmd_validate(args) -> int:
    cfg = load_config(args.config)
    d = os.path.dirname(cfg.node.socket)
    if os.path.isdir(d) and not os.access(d, os.W_OK):
        raise MsdataError(f"socket directory {d!r} is not writable by this user; choose another [node] socket")
    from .endpoint import check_socket_place

    check_socket_place(cfg.node.socket)  # its directory can be made and takes a socket (not /proc, not a file)
    if cfg.cluster is not None:
        from .cluster.net.handshake import load_token

        load_token(cfg.cluster.token_file)  # exists, holds a secret, and only this user may read it
    print(f"node config OK: id={cfg.node.id} socket={cfg.node.socket} role={cfg.role}")
    if args.job:
        from msdata_client.graph import DGraph

        from .admission import check_job
        from .sources import open_source
        from .storage import configure

        configure(cfg.storage)  # remote paths are listed and read with the node's [storage] settings
        spec = DGraph.from_toml(args.job).spec
        check_job(spec, cfg.node)  # [node] allow_transforms and data_roots, as the server checks a registering job
        _load_transforms(spec)
        print(f"job config OK: {spec.name} mesh {spec.mesh.to_dict()} seq_len {spec.seq_len} pad_id {spec.pad_id}")
        warning = pad_warning(spec.pad_id, (s.transform for s in spec.sources))
        if warning:
            print(f"  warning: {warning}")
        for s in spec.sources:
            src = open_source(s, seed=spec.seed, on_read_error=spec.on_read_error)
            try:
                print(f"  source {s.name} ({s.format}): {src.num_samples} samples")
                _print_remote_files(src)
                _probe_source(spec, s, src)
            finally:
                src.close()
    return 0


def _print_remote_files(src) -> None:
    """The objects a source's URIs listed (``validate --job``): count, bytes and the first few, read OK."""
    files = getattr(src, "files", ())
    remote = [f for f in files if "://" in f.path]
    if not remote:
        return
    total = sum(f.size for f in remote)
    print(
        f"    {len(remote)} object(s), {total} bytes, listed and read: {', '.join(f.path for f in remote[:3])}"
        + (" ..." if len(remote) > 3 else "")
    )


def _load_transforms(spec: JobSpec) -> None:
    """Build every source's transform as its loader would (a factory opens its files: a missing tokenizer is
    an error here, not a bad sample per record once serving)."""
    from .job.images import source_transform
    from .transforms import load_transform

    for s in spec.sources:
        try:
            load_transform(source_transform(spec, s))
        except ConfigError as e:
            raise ConfigError(f"source {s.name!r}: {e}") from None


def _probe_source(spec: JobSpec, s: SourceSpec, src: Source) -> None:
    """Push the first records of a source through its transform; an error when none comes out good."""
    from .job.images import source_transform
    from .loader.sampleread import probe
    from .sources.base import BadSample

    transform = source_transform(spec, s)
    got = probe(src, transform, spec.seed, count=_PROBE_RECORDS)
    bad = [(o, r) for o, r in got if isinstance(r, BadSample)]
    print(f"    first {len(got)} records through transform {transform!r}: {len(got) - len(bad)} good")
    for _, r in bad[:3]:
        print(f"    bad ({r.reason}) at {r.location}: {r.detail}")
    if got and len(bad) == len(got):
        r = bad[0][1]
        raise MsdataError(
            f"source {s.name!r}: none of its first {len(got)} records is good ({r.reason} at {r.location}: "
            f"{r.detail}); a job reading it would stop. Check its files, column and transform"
        )


def _cmd_cleanup(args) -> int:
    from .shm import cleanup

    removed, kept = cleanup()
    for n in removed:
        print(f"removed {n}")
    print(f"removed {len(removed)} stale segment(s); kept {len(kept)} of live servers")
    return 0


def _cmd_demo(args) -> int:
    _lean_memory()
    configure_logging(args.log_level or "WARNING", "text")
    if args.video:  # captions, pages and clips in one job (generated clips; needs PyAV and Pillow)
        from .demo_video import run_video_demo

        return run_video_demo(steps=args.steps if args.steps is not None else 20)
    if args.vlm:  # a small image-text job (generated images; needs Pillow)
        from .demo_vlm import run_vlm_demo

        return run_vlm_demo(steps=args.steps if args.steps is not None else 30)
    from .demo import run_demo

    return run_demo(steps=args.steps if args.steps is not None else 200, ranks=args.ranks)


def build_parser() -> argparse.ArgumentParser:
    """The `msdata-server` command line: one subcommand per verb (ARCHITECTURE §4.1), each with its options."""
    from . import __version__

    p = argparse.ArgumentParser(prog="msdata-server", description="msdata node data server")
    p.add_argument("--version", action="version", version=f"msdata-server {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="run the node daemon in the foreground")
    s.add_argument("--config", help="node.toml (default: built-in defaults)")
    s.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, help="override [node] log_level")
    s.add_argument("--log-format", choices=LOG_FORMATS, help="override [node] log_format")
    s.set_defaults(fn=_cmd_serve)
    d = sub.add_parser("demo", help="run the embedded default job end to end and print a summary")
    d.add_argument(
        "--steps",
        type=_at_least_one,
        default=None,
        help="training steps to run (default 200; 30 with --vlm, 20 with --video)",
    )
    d.add_argument("--vlm", action="store_true", help="an image-text job instead (generated images; needs Pillow)")
    d.add_argument(
        "--video",
        action="store_true",
        help="captions, pages, short and long clips in one job (generated clips; needs PyAV and Pillow)",
    )
    d.add_argument("--ranks", type=_at_least_one, default=4, help="simulated trainer ranks")
    d.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, help="log level (default WARNING)")
    d.set_defaults(fn=_cmd_demo)
    st = sub.add_parser("status", help="show a running server's jobs, ranks, rates and memory")
    st.add_argument("--endpoint", help="the server's Unix socket (default: as for clients)")
    st.add_argument("--config", help="node.toml: use its [node] socket (when --endpoint is not given)")
    st.add_argument("--json", action="store_true", help="print exactly one JSON object")
    st.add_argument("--watch", action="store_true", help="redraw a live screen until interrupted")
    st.add_argument("--interval", type=_positive, default=2.0, help="seconds between --watch redraws (default 2)")
    st.set_defaults(fn=_cmd_status)
    h = sub.add_parser(
        "health",
        help="exit 0 when the server answers with a known role and can save planner states, else 1 (for probes)",
    )
    h.add_argument("--endpoint", help="the server's Unix socket (default: as for clients)")
    h.add_argument("--config", help="node.toml: use its [node] socket (when --endpoint is not given)")
    h.add_argument("--timeout", type=_positive, default=5.0, help="seconds to wait for the answer (default 5)")
    h.set_defaults(fn=_cmd_health)
    v = sub.add_parser("validate", help="check configs and data paths without serving")
    v.add_argument("--config", help="node.toml")
    v.add_argument("--job", help="job.toml to check too (sources are opened)")
    v.set_defaults(fn=_cmd_validate)
    ln = sub.add_parser("lineage", help="which document pieces made steps A..B (replayed, from a server or offline)")
    ln.add_argument("--job", required=True, help="a running job's name, or its job.toml to replay offline")
    ln.add_argument("--steps", required=True, help="A:B, the steps from A up to B (excluded)")
    ln.add_argument("--state", help="offline: a trainer's saved loader.state_dict() JSON to replay from")
    ln.add_argument("--rank", type=int, help="only the micro-batches of this trainer rank's data-parallel group")
    ln.add_argument("--sample", type=int, help="only the rows of this sample id (where one document went)")
    ln.add_argument(
        "--source", help="only the rows of this source (sample ids repeat across sources: give both to name one)"
    )
    ln.add_argument("--out", help="write Parquet here instead of printing a table")
    ln.add_argument("--endpoint", help="the server's Unix socket (default: as for clients)")
    ln.add_argument("--config", help="node.toml: use its [node] socket (when --endpoint is not given)")
    ln.add_argument("--timeout", type=_positive, default=600.0, help="seconds to wait for the server (default 600)")
    ln.set_defaults(fn=_cmd_lineage)
    c = sub.add_parser("cleanup", help="remove shared-memory segments whose server is gone")
    c.set_defaults(fn=_cmd_cleanup)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except MsdataError as e:
        print(f"msdata-server {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
