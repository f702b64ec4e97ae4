"""The leader's side of cluster jobs: one coordinator per run (start barrier, planner, plans to every node,
mixture changes), catching up nodes that lack plans, and the fenced planner states in etcd."""
