"""The cluster's network: etcd access, membership and leader election, authenticated peer links with their
framing and handshake, request/reply over the links, and the node's place in the cluster (``runtime.py``).
Nothing here knows of jobs or plans."""
