"""``msdata-server lineage``: from a running server (``--job NAME``) or offline (``--job job.toml``, from the
beginning or from ``--state FILE``, a trainer's saved ``loader.state_dict()``); a table, or ``--out`` Parquet."""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Mapping

import numpy as np
import orjson

from msdata_client import lineage as rows_io
from msdata_client.spec import JobSpec

from ..errors import CheckpointError, ConfigError, MsdataError
from ..planner.spec import planner_config
from ..planner.state import K_PENDING
from .data import DataView
from .query import Query, answer

__all__ = ["format_table", "load_saved", "offline", "parse_steps", "planner_state", "run"]

_SHOWN = ("step", "micro", "dp_rank", "row", "offset", "length", "source", "file", "file_row", "sample_id", "piece",
          "skipped")  # fmt: skip


def parse_steps(text: str) -> tuple[int, int]:
    """``A:B`` (half-open) as two ints; ConfigError naming the form."""
    a, sep, b = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(a), int(b)
    except ValueError:
        raise ConfigError(f"--steps {text!r} must be A:B, the steps from A up to B (excluded), e.g. 100:104") from None


def planner_state(saved: object) -> tuple[dict, list[list[int]]]:
    """The planner state in a trainer's saved ``loader.state_dict()`` (or a bare planner state) and the step ranges
    it skips: those recorded in it, and a skip the trainer asked for before iterating (``loader.skip``)."""
    if not isinstance(saved, dict):
        raise CheckpointError(f"--state must hold a JSON object (a loader.state_dict()), not {type(saved).__name__}")
    planner = saved.get("planner", saved)
    if not isinstance(planner, dict) or "step" not in planner:
        raise CheckpointError("--state holds no planner position (saved before the job started?); leave it out")
    skips = [list(r) for r in planner.get("skips", [])]
    for pending in (saved.get("skip"), planner.get(K_PENDING)):  # asked for (loader.skip), or still to come
        if isinstance(pending, dict) and "start" in pending:  # skip(steps=(A, B))
            skips.append([int(pending["start"]), int(pending["stop"])])
        elif isinstance(pending, dict):
            step = int(planner["step"])
            skips.append([step, step + int(pending["steps"])])
    return planner, skips


def load_saved(path: str, spec: JobSpec) -> dict:
    """A trainer's saved ``loader.state_dict()`` from a JSON file, checked to belong to ``spec``'s data identity
    as ``DataClient.load_state_dict`` checks it (a bare planner state carries no identity and is taken as is)."""
    try:
        with open(path, "rb") as f:
            saved = orjson.loads(f.read())
    except orjson.JSONDecodeError as e:
        raise CheckpointError(
            f"--state {path!r} is not JSON ({e}); it is cut off or not a saved state_dict()"
        ) from None
    except OSError as e:
        raise CheckpointError(f"--state {path!r} cannot be read: {e.strerror or e}") from None
    if isinstance(saved, dict) and "planner" in saved and saved.get("data_digest") != spec.data_digest():
        raise CheckpointError(
            f"--state {path!r} was saved by job {saved.get('job')!r} with another data identity than "
            f"{spec.name!r} (name, seed, sources, transforms, mixture or cost differ); give the state of this job"
        )
    return saved


async def offline(spec: JobSpec, query: Query, saved: Mapping | None) -> dict:
    """Lineage without a server: replay from the job's beginning or from a saved state."""
    base, skips = planner_state(saved) if saved is not None else (None, [])
    data = await DataView.open(spec, None, vision=planner_config(spec).vlm_cost is not None)
    try:
        return await answer(spec, query, data, base=base, skips=skips)
    finally:
        await data.aclose()


def format_table(cols: Mapping[str, np.ndarray]) -> str:
    """The fixed columns as a plain text table (file names shortened to their last 40 characters)."""
    head = list(_SHOWN)
    body = [[str(v) if k != "file" or len(str(v)) <= 40 else "…" + str(v)[-39:] for k, v in zip(head, vals)]
            for vals in zip(*(cols[k].tolist() for k in head))]  # fmt: skip
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in body]
    return "\n".join(lines)


def _is_toml(job: str) -> bool:
    return job.endswith(".toml") or os.path.isfile(job)


def only_source(cols: dict, source: str, sources: list[str]) -> dict:
    """The rows of one source (sample ids repeat across sources: ``--sample ID --source NAME`` names one
    document); ConfigError naming the job's sources when it has no such source."""
    if source not in sources:
        raise ConfigError(f"--source {source!r} is not a source of this job; its sources are {sources}")
    keep = cols["source"] == source
    return {k: v[keep] for k, v in cols.items()}


def run(args) -> int:
    """The subcommand; exit 0, or 2 with one line on stderr."""
    from msdata_client.graph import DGraph
    from msdata_client.wire import request

    try:
        start, stop = parse_steps(args.steps)
        if args.state and not _is_toml(args.job):
            raise ConfigError("--state replays offline: give --job the job's TOML file, not a running job's name")
        if _is_toml(args.job):
            spec = DGraph.from_toml(args.job).spec
            group = spec.group_of(args.rank) if args.rank is not None else None
            query = Query(start=start, stop=stop, group=group, sample=args.sample)
            saved = None
            if args.state:
                saved = load_saved(args.state, spec)
            frame = asyncio.run(offline(spec, query, saved))
            frame = orjson.loads(orjson.dumps(frame, option=orjson.OPT_SERIALIZE_NUMPY))
        else:
            Query(start=start, stop=stop)  # checks the range before asking
            frame = {"job": args.job, "start": start, "stop": stop, "rank": args.rank, "sample": args.sample}
            endpoint = args.endpoint_path
            try:
                frame = request(endpoint, {"t": "lineage", **frame}, timeout=args.timeout)
            except OSError as e:
                raise ConfigError(
                    f"no server at {endpoint!r} ({e}); start one, or give --job the job's TOML to replay offline"
                ) from None
            if frame.get("t") == "refused":
                raise ConfigError(f"the server refused: {frame.get('message')}")
        cols = rows_io.from_wire(frame)
        if args.source is not None:
            cols = only_source(cols, args.source, list(frame["sources"]))
    except (MsdataError, OSError, orjson.JSONDecodeError) as e:
        print(f"msdata-server lineage: {e}", file=sys.stderr)
        return 2
    if args.out:
        try:
            rows_io.write_parquet(cols, args.out)
        except OSError as e:  # pyarrow's errors on a bad path are OSErrors too
            print(f"msdata-server lineage: cannot write --out {args.out!r}: {e}", file=sys.stderr)
            return 2
        print(f"{cols['step'].size} rows written to {args.out}")
    else:
        print(format_table(cols))
    return 0
