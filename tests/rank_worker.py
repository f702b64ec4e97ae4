"""A trainer rank as a separate process, for end-to-end tests: reads N micro-batches and writes what it saw.

usage: python tests/rank_worker.py JOB_JSON ENDPOINT RANK WORLD N OUT [--hold K] [--state STATE_JSON]
       [--save-every K --ckpt CKPT_JSON] [--stall-after M]
Writes OUT as JSON: one record per batch (step, micro, sha256 of every field, sample/source ids). A trainer's
checkpoint: every K batches, CKPT_JSON gets the records so far and state_dict() (written atomically). With
--stall-after M it stops after M batches and waits to be killed.
"""

import hashlib
import json
import os
import sys
import threading

import orjson

import msdata_client as msd


def digest(batch) -> dict:
    rec = {"step": int(batch["step"]), "micro": int(batch["micro"])}
    for k, v in sorted(batch.items()):
        if k in ("step", "micro"):
            continue
        rec[k] = hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()[:16]
    if "sample_ids" in batch:
        rec["ids"] = [[int(s), int(i)] for s, i in zip(batch["source_ids"], batch["sample_ids"])]
    if "tokens" in batch:
        t = batch["tokens"]
        rec["nonpad"] = int((t != 257).sum())
    return rec


def main() -> None:
    job_json, endpoint, rank, world, n, out = sys.argv[1:7]
    hold = 0
    state = None
    save_every, ckpt, stall = 0, None, None
    args = sys.argv[7:]
    while args:
        a = args.pop(0)
        if a == "--hold":
            hold = int(args.pop(0))
        elif a == "--state":
            with open(args.pop(0)) as fh:
                state = json.load(fh)
        elif a == "--save-every":
            save_every = int(args.pop(0))
        elif a == "--ckpt":
            ckpt = args.pop(0)
        elif a == "--stall-after":
            stall = int(args.pop(0))
    with open(job_json, "rb") as fh:
        spec = msd.DGraph.from_dict(orjson.loads(fh.read())).spec
    recs = []
    held = []
    with msd.DataClient(spec, endpoint=endpoint, rank=int(rank), world_size=int(world), connect_timeout=60) as dc:
        if state is not None:
            dc.load_state_dict(state)
        for _ in range(int(n)):
            b = next(dc)
            recs.append(digest(b))
            if hold:
                held.append(b)  # keep batches alive: their slots must stay taken
                held = held[-hold:]
            if save_every and len(recs) % save_every == 0:
                with open(ckpt + ".tmp", "w") as f:
                    json.dump({"batches": recs, "state": dc.state_dict()}, f)
                os.replace(ckpt + ".tmp", ckpt)
            print(len(recs), flush=True)
            if stall is not None and len(recs) == stall:
                threading.Event().wait()  # killed here
        final = dc.state_dict()
    with open(out, "w") as f:
        json.dump({"batches": recs, "state": final}, f)


if __name__ == "__main__":
    main()
