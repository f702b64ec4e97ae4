"""Status for people (issue 26, item 9): per source the target and the delivered share of tokens and the epoch
progress, in the job's status and in the table that both `status` and `status --watch` print."""

from __future__ import annotations

import copy
import re

from msdata_server.job.mixview import mixture_view
from msdata_server.ops.watch import render
from msdata_server.planner.mixture import Mixture

from .status_sample import SAMPLE


def test_mixture_view_reads_target_delivered_and_epochs_from_the_planner_state():
    state = {"step": 10, "mixture": Mixture.constant({"web": 0.7, "code": 0.3}).to_dict(), "cursor": [250, 40]}
    acct = {"web": {"tokens_delivered": 6900}, "code": {"tokens_delivered": 3100}}
    view = mixture_view(state, ["web", "code"], {"web": 100, "code": 400}, acct)
    assert view == {
        "web": {"target": 0.7, "delivered": 0.69, "epochs_completed": 2, "epoch_progress": 0.5},
        "code": {"target": 0.3, "delivered": 0.31, "epochs_completed": 0, "epoch_progress": 0.1},
    }
    empty = mixture_view(None, ["web"], {}, {})
    assert empty == {"web": {"target": None, "delivered": None, "epochs_completed": None, "epoch_progress": None}}


def test_the_table_shows_delivered_against_target_per_source():
    st = copy.deepcopy(SAMPLE)
    st["jobs"][0]["mixture"] = {
        "web": {"target": 0.7, "delivered": 0.6912345678901234, "epochs_completed": 2, "epoch_progress": 0.5},
        "code": {"target": 0.3, "delivered": None, "epochs_completed": None, "epoch_progress": None},
    }
    screen = render(st)
    assert re.search(r"^  source\s+target\s+delivered\s+epochs\s+epoch read$", screen, re.M), screen
    assert re.search(r"^  web\s+70\.0%\s+69\.1%\s+2\s+50\.0%$", screen, re.M), screen
    assert re.search(r"^  code\s+30\.0%\s+-\s+-\s+-$", screen, re.M), screen
    assert "6912345678" not in screen
    assert all(len(line) <= 80 for line in screen.splitlines())
