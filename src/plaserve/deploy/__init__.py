"""Running plaserve on the platforms fleets already use: Ray Serve (``plaserve ray-serve``, the
``plaserve[ray]`` extra). The Kubernetes manifests and the Grafana dashboard live in the repository's
``deploy/`` folder (docs/DEPLOY.md).

Nothing here is imported by the rest of plaserve; only these modules import ``ray``.
"""
