"""Lineage by replay: the plan of any step is recomputed from the nearest saved planner state, so nothing per
sample is stored (ARCHITECTURE §1).

``replay`` re-plans steps through the job's own rules; ``rows`` turns plans into the lineage columns
(``msdata_client.lineage``); ``data`` opens a job's sources (its own loaders) for the lengths a replay reads
and the files its rows name; ``query`` answers one lineage query (the server's and the offline CLI's alike);
``serve`` and ``window`` answer the node's ``lineage`` and ``replay`` requests; ``skip`` applies
``loader.skip`` at a run's start; ``accounting`` turns a state into tokens and documents per source;
``command`` is ``msdata-server lineage``.
"""

__all__: list[str] = []  # import the modules themselves (job/ imports lineage.replay: no cycle through here)
